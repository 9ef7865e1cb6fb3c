"""Bad input on the command line: one line ``vitlab: error: ...`` on stderr naming the problem, exit code 2, never a
traceback nor a silently wrong result (truncated files, foreign files, misspelt names, out-of-range values)."""

from __future__ import annotations

import shutil

import pytest
from PIL import Image

from tests.train.conftest import tiny_config
from vitlab.cli import main
from vitlab.train import fit


@pytest.fixture(scope="session")
def cli_run(tmp_path_factory):
    """A finished 1-epoch run of a 1-block pico ViT (1 input channel) on fake 16x16 images: the run directory."""
    out = tmp_path_factory.mktemp("cli-errors")
    fit(tiny_config(out, epochs=1))
    return out / "run"


@pytest.fixture
def run_copy(cli_run, tmp_path):
    """A copy of the shared run (links kept) that a test may damage."""
    return shutil.copytree(cli_run, tmp_path / "run", symlinks=True)


@pytest.fixture
def image(tmp_path):
    path = tmp_path / "img.png"
    Image.new("RGB", (20, 12), (90, 120, 200)).save(path)
    return path


def _one_line_error(capsys, argv: list[str], *words: str) -> str:
    """Run the CLI in-process: exit code 2 and exactly one stderr line, holding every one of ``words``."""
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("vitlab: error: "), err
    for w in words:
        assert w in err, (w, err)
    return err


def _cut(path, keep: float = 0.5) -> None:
    data = path.read_bytes()
    path.write_bytes(data[:int(len(data) * keep)])


# ---------------------------------------------------------------- ONNX files


def _tiny_onnx(path) -> None:
    """A valid one-node ONNX model carrying vitlab's metadata, as ``vitlab export`` writes it."""
    onnx = pytest.importorskip("onnx")
    from onnx import TensorProto, helper

    from vitlab.export import ExportMeta

    graph = helper.make_graph([helper.make_node("Identity", ["image"], ["logits"])], "g",
                              [helper.make_tensor_value_info("image", TensorProto.FLOAT, [1, 4])],
                              [helper.make_tensor_value_info("logits", TensorProto.FLOAT, [1, 4])])
    model = helper.make_model(graph)
    helper.set_model_props(model, {"vitlab": ExportMeta(num_classes=4).to_json()})
    onnx.save(model, str(path))


def test_predict_onnx_foreign_file(tmp_path, image, capsys):
    pytest.importorskip("onnxruntime")
    foreign = tmp_path / "model.onnx"
    foreign.write_text("hello, not a model\n")
    _one_line_error(capsys, ["predict", "--onnx", str(foreign), str(image)], str(foreign), "not an ONNX model")
    shutil.copy(image, foreign)  # an image under an .onnx name
    _one_line_error(capsys, ["predict", "--onnx", str(foreign), str(image)], str(foreign), "not an ONNX model")


def test_predict_onnx_truncated_file(tmp_path, image, capsys):
    pytest.importorskip("onnxruntime")
    path = tmp_path / "model.onnx"
    _tiny_onnx(path)
    _cut(path)
    _one_line_error(capsys, ["predict", "--onnx", str(path), str(image)], str(path), "truncated or corrupt")


def test_predict_onnx_directory_of_images(tmp_path, capsys):
    pytest.importorskip("onnxruntime")
    path = tmp_path / "model.onnx"
    _tiny_onnx(path)
    _one_line_error(capsys, ["predict", "--onnx", str(path), str(tmp_path)], "is a directory")


# ---------------------------------------------------------------- checkpoints


def test_resume_from_a_truncated_trainer_state(run_copy, capsys):
    trainer = run_copy / "last" / "trainer.pt"
    _cut(trainer)
    _one_line_error(capsys, ["train", "--resume", str(run_copy), "--epochs", "2"], "trainer.pt",
                    "truncated or corrupt")


def test_truncated_weights(run_copy, capsys):
    _cut(run_copy / "last" / "model.safetensors")
    _one_line_error(capsys, ["eval", "--checkpoint", str(run_copy / "last")], "model.safetensors",
                    "truncated or corrupt")


def test_resume_with_another_model_names_the_field(cli_run, capsys):
    err = _one_line_error(capsys, ["train", "--resume", str(cli_run), "--epochs", "2", "--model",
                                   "deit_tiny_patch16_224"], "model", "vit_pico_patch8_32", "cannot change model")
    assert "it may change epochs" in err


# ---------------------------------------------------------------- predict


def test_predict_a_directory(cli_run, tmp_path, capsys):
    _one_line_error(capsys, ["predict", "--checkpoint", str(cli_run), str(tmp_path)], str(tmp_path), "is a directory")


def test_predict_topk_zero(cli_run, image, capsys):
    _one_line_error(capsys, ["predict", "--checkpoint", str(cli_run), str(image), "--topk", "0"],
                    "--topk must be >= 1, got 0")


@pytest.mark.parametrize("device, words", [("bogus", ("not a device name",)),
                                           ("cuda:99", ("'cuda:99' requested but", "CUDA"))])
def test_a_device_this_machine_lacks_is_named(cli_run, image, device, words, capsys):
    """Refused while the command line is read (argparse's one line), by every command with ``--device``: never a
    driver's traceback at the first transfer. No machine has a cuda:99."""
    for argv in (["predict", "--checkpoint", str(cli_run), str(image)], ["eval", "--checkpoint", str(cli_run)],
                 ["generate", "--checkpoint", "llama_tiny", "hi"], ["zeroshot", "--checkpoint", str(cli_run)],
                 ["probe", "--checkpoint", str(cli_run)], ["bench", "attention"], ["analyze", "memory"]):
        _one_line_error(capsys, [*argv, "--device", device], "argument --device", *words)
    _one_line_error(capsys, ["train", "--device", device], *words)  # a config field: checked as the run starts


# ---------------------------------------------------------------- distillation


def test_teacher_with_other_input_channels_is_named(cli_run, tmp_path, capsys):
    # the run takes 1 channel; a student of 3 makes the data 3-channel
    _one_line_error(capsys, ["train", "--model", "vit_pico_patch8_32", "--model_kwargs.depth", "1",
                             "--model_kwargs.in_chans", "3", "--data", "fake", "--data.fake_num_samples", "16",
                             "--data.fake_num_classes", "4", "--data.fake_img_size", "16", "--distill", "hard",
                             "--teacher", str(cli_run), "--epochs", "1", "--quiet",
                             "--output_dir", str(tmp_path / "student")],
                    f"the teacher {cli_run} takes 1 input channels but the data has 3")


# ---------------------------------------------------------------- export


def test_export_misspelt_model_lists_close_matches(tmp_path, capsys):
    _one_line_error(capsys, ["export", "deit_tiny_patch16_22", "--format", "torchscript", "--out",
                             str(tmp_path / "m.pt")], "unknown model 'deit_tiny_patch16_22'",
                    "close matches: deit_tiny_patch16_224")
    assert capsys.readouterr().out == "" and not (tmp_path / "m.pt").exists()


def test_export_random_weights_warns_once(tmp_path, capsys):
    import torch

    import vitlab

    out = tmp_path / "m.pt"
    assert main(["export", "vit_pico_patch8_32", "--format", "torchscript", "--out", str(out)]) == 0
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "random-init weights" in err and "--checkpoint" in err
    weights = tmp_path / "pico.pth"
    torch.save(vitlab.create_model("vit_pico_patch8_32").state_dict(), weights)
    assert main(["export", "vit_pico_patch8_32", "--checkpoint", str(weights), "--format", "torchscript",
                 "--out", str(out)]) == 0
    assert capsys.readouterr().err == ""


def test_export_checkpoint_with_a_run(cli_run, tmp_path, capsys):
    _one_line_error(capsys, ["export", str(cli_run), "--checkpoint", "w.pth", "--format", "torchscript", "--out",
                             str(tmp_path / "m.pt")], "--checkpoint loads weights into a registered MODEL")
    _one_line_error(capsys, ["export", "vit_pico_patch8_32", "--checkpoint", str(cli_run), "--format",
                             "torchscript", "--out", str(tmp_path / "m.pt")], "is a directory",
                    f"vitlab export {cli_run}")


# ---------------------------------------------------------------- probe


@pytest.mark.parametrize("flag, value, words", [
    ("--k", "0", "--k must be >= 1, got 0"),
    ("--epochs", "0", "--epochs must be >= 1, got 0"),
    ("--blocks", "-1", "--blocks must be >= 1, got -1"),
    ("--temperature", "0", "--temperature must be > 0, got 0.0"),
    ("--lr", "-0.1", "--lr must be > 0, got -0.1"),
    ("--batch-size", "0", "--batch-size must be >= 1, got 0"),
])
def test_probe_names_the_offending_value(flag, value, words, capsys):
    _one_line_error(capsys, ["probe", "--checkpoint", "random:vit_pico_patch8_32", flag, value], words)


def test_probe_misspelt_random_model(capsys):
    _one_line_error(capsys, ["probe", "--checkpoint", "random:vit_pico_patch8_3"], "random:vit_pico_patch8_3",
                    "close matches: vit_pico_patch8_32")


def test_probe_output_is_a_directory(tmp_path, capsys):
    _one_line_error(capsys, ["probe", "--checkpoint", "random:vit_pico_patch8_32", "--output", str(tmp_path)],
                    f"--output {tmp_path} is a directory")

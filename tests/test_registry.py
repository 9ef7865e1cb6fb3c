"""The one model registry: every model with its task, listed and built by the same functions; capability packages
register on demand (``import vitlab`` imports none of them), found by the ``model_configs`` module convention."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import vitlab
from vitlab import registry
from vitlab.cli import main

PKG = Path(vitlab.__file__).parent
# capability packages by convention: the ones that bring Trainer tasks or registered models of their own
CAPABILITIES = sorted(p.name for p in PKG.iterdir() if (p / "tasks.py").exists() or (p / "model_configs.py").exists())


def _run(code: str) -> str:
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout


def test_import_vitlab_imports_no_capability():
    out = _run("""
        import json, sys, vitlab
        print(json.dumps(sorted({m.split(".")[1] for m in sys.modules if m.startswith("vitlab.")})))
    """)
    loaded = set(json.loads(out))
    assert {"clip", "dense"} <= set(CAPABILITIES)
    assert not loaded & set(CAPABILITIES), f"import vitlab imported {sorted(loaded & set(CAPABILITIES))}"


@pytest.mark.parametrize("call", [
    "vitlab.create_model('clip_vit_pico_patch8', image_depth=1, text_depth=1).__class__.__name__ == 'CLIP'",
    "vitlab.is_model('dpt_vit_base_patch16_384')",
    "vitlab.get_model_config('dpt_vit_base_patch16_384_depth').task == 'depth'",
    "'setr_pup_vit_large_patch16_512' in vitlab.list_models()",
])
def test_first_lookup_or_listing_registers_the_capabilities(call):
    """Each entry point, first thing in a fresh process, finds the capabilities' models; only the packages with a
    ``model_configs`` module are imported for it."""
    out = _run(f"""
        import json, sys, vitlab
        assert {call}
        print(json.dumps(sorted({{m.split(".")[1] for m in sys.modules if m.startswith("vitlab.")}})))
    """)
    with_configs = {p.parent.name for p in PKG.glob(f"*/{registry.CONFIGS_MODULE}.py")}
    assert {"clip", "dense"} <= with_configs
    assert set(json.loads(out)) & set(CAPABILITIES) <= with_configs


def test_every_model_has_a_task_and_classifiers_default_to_classify():
    assert vitlab.ModelConfig().task == "classify"
    assert vitlab.model_tasks() == ["blip", "caption", "classify", "contrastive", "depth", "generate", "segment"]
    names = vitlab.list_models()
    by_task = {t: vitlab.list_models(task=t) for t in vitlab.model_tasks()}
    assert sorted(n for ns in by_task.values() for n in ns) == names  # each model in exactly one task
    assert all(vitlab.get_model_config(n).family not in ("clip", "dense") for n in by_task["classify"])
    assert all(vitlab.get_model_config(n).family == "clip" for n in by_task["contrastive"])
    assert {"dpt_vit_base_patch16_384", "setr_pup_vit_large_patch16_512"} <= set(by_task["segment"])
    assert {"dpt_vit_base_patch16_384_depth", "linear_depth_vit_small_patch16_448"} <= set(by_task["depth"])
    assert vitlab.list_models("dpt_*", task=("segment", "depth")) == [
        "dpt_vit_base_patch16_384", "dpt_vit_base_patch16_384_depth", "dpt_vit_large_patch16_384",
        "dpt_vit_large_patch16_384_depth"]
    assert vitlab.list_models("dpt_*", task="classify") == []


def test_unknown_task_is_one_line_naming_the_known_ones():
    with pytest.raises(ValueError, match="unknown model task 'detect'; known tasks: blip, caption, classify, "
                                         "contrastive, depth, generate, segment$"):
        vitlab.list_models(task="detect")


def test_a_new_task_registers_like_any_other(monkeypatch):
    monkeypatch.setattr(registry, "_ENTRYPOINTS", dict(registry._ENTRYPOINTS))
    monkeypatch.setattr(registry, "_CONFIGS", dict(registry._CONFIGS))

    @vitlab.register_model(config=vitlab.ModelConfig(family="toy", task="detect"))
    def toy_detector(**kwargs):
        return vitlab.create_model("vit_pico_patch4_32", **kwargs)

    assert "detect" in vitlab.model_tasks() and vitlab.list_models(task="detect") == ["toy_detector"]
    assert vitlab.create_model("toy_detector", num_classes=2).pretrained_cfg.task == "detect"


def test_vitlab_models_task_filter(capsys):
    assert main(["models", "*_vit_small_*", "--task", "segment", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [r["name"] for r in rows] == ["segmenter_linear_vit_small_patch16_512",
                                         "segmenter_mask_vit_small_patch16_512", "vit_adapter_vit_small_patch16_512"]
    assert {r["task"] for r in rows} == {"segment"} and {r["family"] for r in rows} == {"dense"}
    assert main(["models", "deit_tiny_patch16_224", "--task", "classify", "--json"]) == 0
    assert [r["task"] for r in json.loads(capsys.readouterr().out)] == ["classify"]


def test_vitlab_models_unknown_task_exits_2_with_one_line():
    proc = subprocess.run([sys.executable, "-m", "vitlab", "models", "--task", "detect"], capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert proc.stderr.strip() == ("vitlab: error: unknown model task 'detect'; known tasks: blip, caption, "
                                   "classify, contrastive, depth, generate, segment")


def test_an_argument_the_model_does_not_take_is_one_line(capsys):
    """create_model names the argument (ValueError), and `vitlab info` exits 2 with that line, no traceback."""
    with pytest.raises(ValueError, match=r"^llama_tiny does not take img_size$"):
        vitlab.create_model("llama_tiny", img_size=8)
    assert main(["info", "llama_tiny", "--img-size", "8"]) == 2
    assert capsys.readouterr().err.strip() == "vitlab: error: llama_tiny does not take img_size"
    with pytest.raises(ValueError, match=r"^clip_vit_pico_patch8 does not take embed_dim \(the model sets it "
                                         r"itself\)$"):
        vitlab.create_model("clip_vit_pico_patch8", embed_dim=32)

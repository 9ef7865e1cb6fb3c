"""Every command line of README.md and docs/*.md runs as written, from a fresh clone, offline, on the CPU.

The commands are read from the fenced shell blocks (```bash, ```sh or no language): every line that starts with
``vitlab``, ``python -m vitlab``, ``torchrun ... -m vitlab`` or ``python benchmarks/...`` (after ``NAME=value``
and ``time`` prefixes), with ``\\`` continuations joined, ``# comments`` dropped, one-line ``for V in ...; do
...; done`` loops and ``{a,b}`` braces expanded as the shell would. What the docs leave to the reader stands in:

- a run (``runs/RUN``, ``runs/<run>``, ``RUN/best/...``) is a seconds-long run of the kind the line needs
  (``FIXTURE_RUNS``, chosen by ``RUN_FOR`` or by the block's training line above it), trained once;
- the images the docs name (``img1.png``, ``cat.jpg`` ...) are small real pictures in the working folder;
- a dataset that is not here (``imagefolder:/data/x``, ``segfolder:~/data/ade`` ...) is a tiny folder of the
  same layout (``STANDINS``).

Two tests:

- ``test_doc_command_parses`` (default suite): every command at least parses. The cheap ones run in full, in
  process through ``vitlab.cli.main``: ``models``, ``info``, ``--help``, ``eval`` and ``predict --checkpoint``
  (with ``--no-optimize``: tuning through vitlab.optimize compiles for seconds); ``train`` / ``pretrain`` run
  with ``--print_config`` (the whole config is built and checked); the others go through the parser only; a
  ``python benchmarks/`` line's script must exist and define every flag the line gives it.
- ``test_doc_block_runs`` (``-m slow``): every command of a block in full, in order, in one working folder (so
  ``vitlab predict --onnx model.onnx`` reads the file the export line above wrote), with ``tiny_flags``: a
  training line gets ``--stop_after 1`` (and ``--epochs 1`` unless it names its schedule; a resume one more
  epoch), ``--output_dir`` in the working folder and, for a large model on full data, ``SHRINK``'s few images;
  a benchmark its fewest runs at batch 2. A later ``RUN`` of the block is the run its training line made.

A line that cannot run here matches an entry of ``SKIPS`` (a pattern and the reason, as data), so a new doc line
that fails is a test failure, never silently skipped; an entry that matches no line fails too.
"""

from __future__ import annotations

import contextlib
import glob
import io
import itertools
import os
import re
import shlex
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from unittest import mock

import numpy as np
import pytest
import torch
from filelock import FileLock
from PIL import Image

from vitlab.cli import build_parser, import_plugins, main

ROOT = Path(__file__).resolve().parents[1]
DOC_FILES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
SHELL_LANGS = {"", "bash", "sh", "shell", "console"}


# ---------------------------------------------------------------------------------------------- what is skipped


@dataclass(frozen=True)
class Skip:
    """Command lines matching ``pattern`` (a regex searched in the command's text) do not run here."""

    pattern: str
    reason: str
    parses: bool = True  # still checked by the parser in the default test (False: not a command at all)


SKIPS: tuple[Skip, ...] = (
    # not commands: patterns and synopses
    Skip(r"(^| )\.\.\.( |$)", "a pattern with `...` (elided flags), not a command", parses=False),
    Skip(r"^vitlab \w+ \| \w+$", "a synopsis of two verbs, not a command", parses=False),
    Skip(r"^vitlab analyze TOOL$", "a synopsis (TOOL: attention, spectrum, ...), not a command", parses=False),
    Skip(r"^vitlab export MODEL\|RUN$", "a synopsis (MODEL|RUN), not a command", parses=False),
    # hardware, processes and files that are not here
    Skip(r"--device cuda", "needs a CUDA GPU"),
    Skip(r"^torchrun ", "several processes / nodes (torchrun)"),
    Skip(r"openclip:", "needs OpenCLIP weights (a download)"),
    Skip(r"fashion-mnist:/usr/share/datasets", "Fashion-MNIST is not on this machine (offline)"),
    Skip(r"--checkpoint (BASE|FT|CONTROL)\b|--config BASE/", "uses the Fashion-MNIST run of the line above"),
    Skip(r"runs/base/", "needs a trained DeiT-S run (runs/base): hours on the CPU"),
    # benchmark scripts: minutes of timing (kernels built, models compiled, many rounds)
    Skip(r"^python benchmarks/(optimize_vs_timm|hilo_cpu|clip_encode_image|tokens|export_speed|dpt_vs_transformers"
         r"|dense_demo|llama_generate|vlm_demo|vlm_train_throughput|loader_throughput|train_mfu|eager_vs_timm|cait_folded"
         r"|packed_linear_cpu)\.py",
         "a benchmark script: minutes of compiling, training or timing on the CPU"),
    Skip(r"--checkpoint ~/llama-2", "needs Llama 2 weights (a download)"),
    Skip(r"--init llava-1.5-7b-hf/", "needs LLaVA-1.5-7B's transformers weights (a download)"),
    Skip(r"--tokenizer tokenizer.model", "needs a SentencePiece tokenizer.model (Llama's is a download)"),
    Skip(r"--data hf:", "needs a Hugging Face dataset (a save_to_disk folder, a parquet file or the Hub, online)"),
    Skip(r"^vitlab analyze window-study --epochs", "trains six LITv2-S on digits at 128 px: 90 s each on 2 cores"),
)


def skip_of(text: str) -> Skip | None:
    """The first entry of ``SKIPS`` that matches the command's text, else None."""
    return next((s for s in SKIPS if re.search(s.pattern, text)), None)


# ---------------------------------------------------------------------------------------------- extraction


@dataclass(frozen=True)
class DocCommand:
    """One command line of a doc: its place, its words (after the shell's quoting), its environment prefix and
    the values of the enclosing ``for`` loops."""

    path: str
    line: int
    block: int
    words: tuple[str, ...]
    env: tuple[tuple[str, str], ...] = ()
    loops: tuple[tuple[str, tuple[str, ...]], ...] = ()

    @property
    def text(self) -> str:
        return " ".join(self.words)

    @property
    def where(self) -> str:
        return f"{self.path}:{self.line}"

    @property
    def argv(self) -> list[str]:
        """The arguments after ``vitlab`` / ``python -m vitlab`` (empty for other programs)."""
        w = list(self.words)
        if w[0] == "vitlab":
            return w[1:]
        if w[0] in ("python", "python3") and w[1:3] == ["-m", "vitlab"]:
            return w[3:]
        return []

    @property
    def script(self) -> str | None:
        """``benchmarks/NAME.py`` of a ``python benchmarks/NAME.py ...`` line, else None."""
        w = self.words
        return w[1] if w[0] in ("python", "python3") and w[1].startswith("benchmarks/") else None

    @property
    def verb(self) -> str:
        """``train``, ``bench models``, ``analyze memory``, ``eval`` ... or ``benchmarks/NAME.py``."""
        if self.script:
            return self.script
        argv = self.argv
        if not argv:
            return self.words[0]
        return " ".join(argv[:2]) if argv[0] in ("bench", "analyze") and len(argv) > 1 else argv[0]

    def expanded(self) -> list[list[str]]:
        """The words once per combination of the loop values, ``$V`` / ``${V}`` replaced, braces expanded."""
        names = [name for name, _ in self.loops]
        out = []
        for values in itertools.product(*(vals for _, vals in self.loops)):
            words = [shell_vars(w, dict(zip(names, values))) for w in self.words]
            out.append([x for w in words for x in expand_braces(w)])
        return out


def shell_vars(word: str, env: dict[str, str]) -> str:
    """``$V`` and ``${V}`` of ``env`` replaced in ``word`` (others left as they are)."""
    return re.sub(r"\$\{(\w+)\}|\$(\w+)", lambda m: env.get(m[1] or m[2], m[0]), word)


def expand_braces(word: str) -> list[str]:
    """``digit{0,3,7}.png`` -> the three names, as bash expands an unquoted list of plain words."""
    m = re.search(r"\{([\w.-]+(?:,[\w.-]+)+)\}", word)
    if not m:
        return [word]
    return [x for part in m[1].split(",") for x in expand_braces(word[:m.start()] + part + word[m.end():])]


def strip_comment(text: str) -> str:
    """``text`` without a ``# comment``: a ``#`` that starts a word outside quotes, as the shell reads it."""
    quote = None
    for i, ch in enumerate(text):
        if quote:
            quote = None if ch == quote else quote
        elif ch in "'\"":
            quote = ch
        elif ch == "#" and (i == 0 or text[i - 1].isspace()):
            return text[:i].rstrip()
    return text


def shell_blocks(path: Path) -> Iterator[list[tuple[int, str]]]:
    """The (line number, line) lists of the fenced code blocks of ``path`` in a shell language (or none)."""
    block: list[tuple[int, str]] | None = None
    lang = ""
    for n, line in enumerate(path.read_text().splitlines(), 1):
        m = re.match(r"\s*(```|~~~)\s*([\w+-]*)", line)
        if m and block is None:
            block, lang = [], m[2].lower()
        elif m:
            if lang in SHELL_LANGS:
                yield block
            block = None
        elif block is not None:
            block.append((n, line))


def logical_lines(block: list[tuple[int, str]]) -> Iterator[tuple[int, str]]:
    """(first line number, text) with ``\\`` continuations joined and comments dropped."""
    start, parts = None, []
    for n, line in block:
        start = n if start is None else start
        text = strip_comment(line)
        if text.endswith("\\"):
            parts.append(text[:-1].strip())
            continue
        parts.append(text.strip())
        joined = " ".join(p for p in parts if p)
        if joined:
            yield start, joined
        start, parts = None, []


def is_doc_command(words: list[str]) -> bool:
    if not words:
        return False
    if words[0] in ("vitlab", "torchrun"):
        return words[0] == "vitlab" or "vitlab" in words
    return words[0] in ("python", "python3") and len(words) > 1 and (
        words[1].startswith("benchmarks/") or words[1:3] == ["-m", "vitlab"])


def split_prefix(words: list[str]) -> tuple[dict[str, str], list[str]]:
    """``NAME=value`` assignments and ``time`` / ``/usr/bin/time -v`` in front of a command, and the rest."""
    env: dict[str, str] = {}
    i = 0
    while i < len(words):
        if re.fullmatch(r"[A-Z_][A-Z0-9_]*=\S*", words[i]):
            key, _, value = words[i].partition("=")
            env[key] = value
        elif words[i] in ("time", "/usr/bin/time"):
            while i + 1 < len(words) and words[i + 1].startswith("-"):
                i += 1
        else:
            break
        i += 1
    return env, words[i:]


def extract(path: Path) -> list[DocCommand]:
    """The command lines of one doc, in order."""
    rel = str(path.relative_to(ROOT))
    found: list[DocCommand] = []
    for b, block in enumerate(shell_blocks(path)):
        loops: list[tuple[str, tuple[str, ...]]] = []
        for n, text in logical_lines(block):
            words = shlex.split(text)
            while len(words) > 3 and words[0] == "for" and words[2] == "in" and "do" in words:
                k = words.index("do")
                values = tuple(v.rstrip(";") for v in words[3:k] if v.rstrip(";"))
                loops.append((words[1], values))
                words = words[k + 1:]
            ends = 0
            while words and words[-1] in ("done", "done;"):
                ends += 1
                words = words[:-1]
                if words and words[-1].endswith(";"):
                    words[-1] = words[-1][:-1]
                words = [w for w in words if w]
            env, cmd = split_prefix(words)
            if is_doc_command(cmd):
                found.append(DocCommand(rel, n, b, tuple(cmd), tuple(env.items()), tuple(loops)))
            if ends:
                del loops[-ends:]
    return found


def all_commands() -> list[DocCommand]:
    return [c for path in DOC_FILES for c in extract(path)]


COMMANDS = all_commands()


# ---------------------------------------------------------------------------------------------- what stands in


# the run a placeholder needs, by kind: vitlab arguments (``--output_dir`` added) of a seconds-long run
FIXTURE_RUNS: dict[str, list[str]] = {
    # the default pico ViT at its own size, so RUN/best/model.safetensors loads into vit_pico_patch8_32
    "classify": ["train", "--epochs", "1", "--quiet"],
    # a teacher for a student that reads digits as RGB (a DeiT's 3 input channels; the pico ViT's is 1)
    "teacher": ["train", "--model_kwargs.in_chans", "3", "--epochs", "1", "--quiet"],
    "segment": ["train", "--task", "segment", "--data.img_size", "32", "--task_args.shapes_size", "32",
                "--task_args.shapes_train", "8", "--task_args.shapes_eval", "2", "--batch_size", "8", "--epochs", "1",
                "--quiet"],
    "clip": ["train", "--task", "clip", "--model_kwargs.image_depth", "1", "--model_kwargs.text_depth", "1",
             "--data.img_size", "16", "--batch_size", "128", "--epochs", "1", "--quiet"],
    # ToMe's r = 16 a block needs many tokens: the 0.42M-parameter ViT at patch 2 (196 tokens) on digits
    "tokens": ["train", "--model", "vit_micro_patch2_28", "--data.img_size", "28", "--epochs", "1", "--quiet"],
    # the default pico ViT as the backbone, so `vitlab train --init RUN` fine-tunes the default model
    "mae": ["pretrain", "--method", "mae", "--data", "fake", "--data.fake_num_samples", "32",
            "--data.fake_img_size", "32", "--batch_size", "16", "--task_args.decoder_dim", "16",
            "--task_args.decoder_depth", "1", "--task_args.decoder_heads", "2", "--epochs", "1", "--quiet"],
}
_VL_TINY = ["--model_kwargs.vision_depth", "1", "--task_args.scenes_train", "16", "--task_args.scenes_eval", "6",
            "--batch_size", "8", "--epochs", "1", "--task_args.max_new_tokens", "4", "--quiet"]
FIXTURE_RUNS["vqa"] = ["train", "--task", "vqa", "--model_kwargs.text_n_layers", "1", *_VL_TINY]
FIXTURE_RUNS["caption"] = ["train", "--task", "caption", "--model_kwargs.text_n_layers", "1", *_VL_TINY]
FIXTURE_RUNS["blip"] = ["train", "--task", "blip", "--model_kwargs.text_depth", "1", *_VL_TINY]
SSL_METHODS = {"mae", "simclr", "mocov3", "dino", "dinov2"}
# the run a placeholder stands for, by the line (first match); other lines: their block's (see run_kind)
RUN_FOR: tuple[tuple[str, str], ...] = (
    (r"--stage 1 --init ", "caption"), (r"--stage 2 --init ", "vqa"),
    (r"^vitlab (zeroshot|retrieval) ", "clip"),
    (r"^vitlab (probe|pretrain) |--init ", "mae"),
    (r"^vitlab bench tokens ", "tokens"),
    (r'^vitlab predict .*--prompt "a picture of"', "blip"), (r"^vitlab predict .*--prompt ", "vqa"),
)
# run placeholders: runs/<run>, runs/<teacher-run>/best, runs/RUN, RUN/best/model.safetensors
PLACEHOLDER = re.compile(r"^(?:runs/<[\w-]+>|runs/RUN|RUN)(?=/|$)")
# the images the docs name, made in each command's working folder (real photos, real digits)
DOC_IMAGES = ("img1.png", "img2.png", "img.jpg", "cat.jpg", "dog.png", "a.jpg", "b.jpg", "digit.png")
# datasets the docs point at that are not here, and the tiny folder of the same layout that stands in
STANDINS: dict[str, str] = {
    "imagefolder:/data/x": "imagefolder",
    "segfolder:~/data/ade": "segfolder",
    "segfolder:~/data/voc": "segfolder",
    "depthfolder:~/data/nyu": "depthfolder",
    "captions:~/data/pairs": "captions",
}
# training lines of a large model on the full default data (digits: an epoch of DeiT-S at 224 px is minutes on
# the CPU): the slow test appends a few synthetic images of as many classes instead
SHRINK: tuple[tuple[str, tuple[str, ...]], ...] = (
    (r"^vitlab train --model (deit_\w+(?!.*--data[ .=])|levit_128s --data digits )",
     ("--data", "fake", "--data.fake_num_samples", "8", "--data.fake_num_classes", "10")),
    (r"^vitlab train --task (vqa|caption|blip)\b",
     ("--task_args.scenes_train", "16", "--task_args.scenes_eval", "6", "--batch_size", "8")),
)
# flags whose value is written, not read: relative there means the working folder, never the repository
OUTPUT_FLAGS = {"--out", "--json", "--plot", "--output", "--output-dir", "--output_dir"}


def flag_value(words: list[str] | tuple[str, ...], *flags: str) -> str | None:
    """The value of the last of ``flags`` in ``words`` (``--f v`` or ``--f=v``), else None."""
    found = None
    for i, w in enumerate(words):
        key, eq, value = w.partition("=")
        if key in flags:
            found = value if eq else (words[i + 1] if i + 1 < len(words) else None)
    return found


def is_training(cmd: DocCommand) -> bool:
    """A ``vitlab train`` / ``pretrain`` line that trains (not ``--help``)."""
    return cmd.verb in ("train", "pretrain") and "--help" not in cmd.words and "-h" not in cmd.words


def makes_run(cmd: DocCommand) -> bool:
    """A training line that starts a run of its own: any but a resume (one from ``--init`` or ``--teacher`` is
    new, and a later line of its block may start from it: LLaVA's stage 2 from stage 1)."""
    return is_training(cmd) and not flag_value(cmd.words, "--resume")


def kind_of_task(task: str) -> str:
    """The kind of ``FIXTURE_RUNS`` that stands for a run of ``task``: a depth run's is the segment run (a dense
    run: the shapes depth demo tests on a full-size real photo, minutes on the CPU), a pre-training's the MAE run."""
    if task in SSL_METHODS:
        return "mae"
    return "segment" if task == "depth" else task if task in FIXTURE_RUNS else "classify"


def task_of(cmd: DocCommand) -> str:
    return flag_value(cmd.words, "--task", "--method") or ("mae" if cmd.verb == "pretrain" else "classify")


def runnable(cmd: DocCommand) -> bool:
    return skip_of(cmd.text) is None


def run_kind(cmd: DocCommand, block: list[DocCommand]) -> str:
    """Which run a placeholder of ``cmd`` stands for: the first match of ``RUN_FOR``, else the task of the last
    line of the block above it that starts a run (else classify)."""
    kind = next((k for pattern, k in RUN_FOR if re.search(pattern, cmd.text)), None)
    if kind:
        return kind
    above = [c for c in block if c.line < cmd.line and makes_run(c) and runnable(c)]
    return kind_of_task(task_of(above[-1])) if above else "classify"


def digit_image(label: int = 7, size: int = 64) -> Image.Image:
    """A handwritten digit of scikit-learn's set, bright ink on dark, as an RGB picture."""
    from sklearn.datasets import load_digits

    d = load_digits()
    i = int(np.flatnonzero(d.target == label)[-1])
    img = Image.fromarray(np.round(d.images[i] * 255.0 / 16.0).astype(np.uint8))
    return img.resize((size, size), Image.Resampling.NEAREST).convert("RGB")


def photo(size: int = 64) -> Image.Image:
    """scikit-image's bundled cat photo, small."""
    from skimage import data

    return Image.fromarray(data.chelsea()).resize((size, size), Image.Resampling.BILINEAR)


def make_imagefolder(root: Path) -> Path:
    """``train/`` and ``val/`` (and ``test/``) with two classes of small real pictures."""
    for split in ("train", "val", "test"):
        for c, label in enumerate((0, 7)):
            (root / split / f"class{c}").mkdir(parents=True)
            for j in range(2):
                digit_image(label, 32 + 8 * j).save(root / split / f"class{c}" / f"{j}.png")
    return root


def make_depthfolder(root: Path) -> Path:
    """``images/`` and ``depth/`` (16-bit PNG, millimetres): five 64-px scenes, depth growing down the picture."""
    (root / "images").mkdir(parents=True)
    (root / "depth").mkdir()
    base = photo(64)
    for i in range(5):
        base.rotate(90 * i).save(root / "images" / f"{i}.png")
        mm = np.linspace(1000 + 200 * i, 4000, 64, dtype=np.float64)[:, None].repeat(64, 1)
        Image.fromarray(mm.astype(np.uint16)).save(root / "depth" / f"{i}.png")
    return root


def make_segfolder(root: Path) -> Path:
    """``images/`` and ``masks/`` (index PNGs, 3 classes named in ``classes.txt``): five 64-px pictures."""
    (root / "images").mkdir(parents=True)
    (root / "masks").mkdir()
    (root / "classes.txt").write_text("background\ncat\nink\n")
    for i in range(5):
        picture = np.array(photo(64).rotate(90 * i))
        mask = np.zeros((64, 64), np.uint8)
        mask[16:48, 8 * i:8 * i + 32] = 1
        mask[:8] = 2
        picture[:8] = 255
        Image.fromarray(picture).save(root / "images" / f"{i}.png")
        Image.fromarray(mask).save(root / "masks" / f"{i}.png")
    return root


def make_captions(root: Path) -> Path:
    """Twelve small pictures (digits and the photo) and ``captions.csv`` with two captions each and the split."""
    root.mkdir(parents=True)
    rows = ["image,caption,split"]
    for i in range(12):
        split = "train" if i < 8 else "val" if i < 10 else "test"
        picture, words = (photo(32), "a cat") if i % 3 == 0 else (digit_image(i % 10, 32), f"the digit {i % 10}")
        picture.save(root / f"{i}.png")
        rows += [f"{i}.png,a photo of {words},{split}", f"{i}.png,{words} in a picture,{split}"]
    (root / "captions.csv").write_text("\n".join(rows) + "\n")
    return root


STANDIN_MAKERS = {"imagefolder": make_imagefolder, "depthfolder": make_depthfolder, "segfolder": make_segfolder,
                  "captions": make_captions}


def build_once(path: Path, make: Callable[[Path], object]) -> Path:
    """``make(path)``, unless this process or another pytest-xdist worker already did."""
    done = path.with_name(path.name + ".done")
    path.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(f"{path}.lock"):
        if not done.exists():
            shutil.rmtree(path, ignore_errors=True)
            make(path)
            done.touch()
    return path


def train_fixture(kind: str) -> Callable[[Path], None]:
    def make(out: Path) -> None:
        code, output = run_vitlab([*FIXTURE_RUNS[kind], "--output_dir", str(out)])
        assert code == 0, f"the tiny {kind} run failed:\n{output}"

    return make


@dataclass
class DocWorld:
    """Everything the commands refer to: the tiny runs and stand-in data folders (in ``shared``, built on first
    use), and working folders with the images the docs name (in ``work``)."""

    shared: Path
    work: Path
    images: dict[str, Image.Image]

    def run(self, kind: str) -> Path:
        return build_once(self.shared / "runs" / kind, train_fixture(kind))

    def standin(self, kind: str) -> Path:
        return build_once(self.shared / "data" / kind, STANDIN_MAKERS[kind])

    def workdir(self, name: str) -> Path:
        cwd = self.work / name
        cwd.mkdir(parents=True)
        for file in DOC_IMAGES:
            self.images["digit" if file.startswith("digit") else "photo"].save(cwd / file)
        return cwd


@pytest.fixture(scope="session")
def world(tmp_path_factory) -> DocWorld:
    # pytest-xdist workers share the base folder's parent: each tiny run is trained once for all of them
    base = tmp_path_factory.getbasetemp()
    shared = (base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base) / "doc_commands"
    shared.mkdir(exist_ok=True)
    return DocWorld(shared, tmp_path_factory.mktemp("doc_work"), {"digit": digit_image(), "photo": photo()})


# ---------------------------------------------------------------------------------------------- running


def run_vitlab(argv: list[str]) -> tuple[int, str]:
    """``vitlab ARGV`` in this process: (exit code, what it printed). ``--help`` exits through SystemExit."""
    out = io.StringIO()
    threads = torch.get_num_threads()
    if os.environ.get("PYTEST_XDIST_WORKER"):  # the other workers have the other cores: OpenMP threads of two
        torch.set_num_threads(1)              # processes on one core spin against each other (10x slower)
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
            try:
                code = main(argv)
            except SystemExit as e:
                code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    finally:
        torch.set_num_threads(threads)  # --threads N of a command stays with it
    return code, out.getvalue()


def parse_vitlab(argv: list[str]) -> tuple[int, str]:
    """``vitlab ARGV`` through the parser only (flags, choices, required arguments): (exit code, error). As on a
    machine with a GPU: ``--device cuda`` is checked for a device this machine has when the line is read."""
    try:
        with mock.patch("torch.cuda.is_available", return_value=True), \
                mock.patch("torch.cuda.device_count", return_value=1):
            build_parser().parse_args(import_plugins(argv))
    except ValueError as e:
        return 2, f"vitlab: error: {e}"
    except SystemExit as e:
        return (e.code if isinstance(e.code, int) else 1), ""
    return 0, ""


def run_script(words: list[str], env: dict[str, str], cwd: Path) -> tuple[int, str]:
    """``python benchmarks/NAME.py ...`` in a subprocess in ``cwd``."""
    proc = subprocess.run([sys.executable, *words[1:]], cwd=cwd, env={**os.environ, **env}, capture_output=True,
                          text=True, timeout=600)
    return proc.returncode, proc.stdout + proc.stderr


def check_script_flags(words: list[str]) -> None:
    """A benchmark script line, statically: the script exists and defines every ``--flag`` the line gives it (itself
    or through a ``benchmarks/_NAME.py`` helper it imports, ``from _NAME import ...``)."""
    script = Path(words[1])
    assert script.is_file(), f"{words[1]} does not exist"
    source = script.read_text()
    for helper in re.findall(r"^from (_[a-z]\w*) import", source, flags=re.M):  # not __future__
        source += (script.parent / f"{helper}.py").read_text()
    for w in words[2:]:
        flag = w.partition("=")[0]
        if flag.startswith("--"):
            assert f'"{flag}"' in source, f"{words[1]} has no flag {flag}"


def substitute(words: list[str], cmd: DocCommand, block: list[DocCommand], world: DocWorld, cwd: Path,
               made: dict[str, Path] | None = None) -> list[str]:
    """The words with the placeholders replaced (a run of the block's own if ``made`` has one of the kind, else a
    tiny run), the stand-in data, the repository's files as absolute paths (the command runs elsewhere) and the
    folders of the files it writes made."""
    out = []
    for i, w in enumerate(words):
        prev = words[i - 1] if i else ""
        m = PLACEHOLDER.match(w)
        if m:
            kind = "teacher" if m[0] == "runs/<teacher-run>" else run_kind(cmd, block)
            run = (made or {}).get(kind) or world.run(kind)
            w = str(run) + w[m.end():]
        elif w in STANDINS:
            w = f"{w.partition(':')[0]}:{world.standin(STANDINS[w])}"
        elif prev in OUTPUT_FLAGS:
            (cwd / w).parent.mkdir(parents=True, exist_ok=True)
        elif not w.startswith("-") and ("/" in w or "*" in w) and not (cwd / w).exists():
            hits = sorted(glob.glob(str(ROOT / w)))  # the shell's glob; an input file of the repository
            if hits and all(Path(h).is_file() for h in hits):
                out.extend(hits)
                continue
        out.append(w)
    return out


def tiny_flags(cmd: DocCommand, words: list[str], n: int) -> list[str]:
    """What makes a line quick without changing what it shows: one epoch (a resume: one more; a line that names
    its --epochs keeps that schedule, stopped after the first), its run under the working folder; the fewest
    timing runs of a benchmark or an analysis, at a small batch."""
    if is_training(cmd):
        if flag_value(words, "--resume"):
            return ["--epochs", "2", "--stop_after", "2", "--quiet"]
        out = [] if flag_value(words, "--output_dir", "--output-dir") else ["--output_dir", f"runs/line{n}"]
        epochs = [] if flag_value(words, "--epochs") else ["--epochs", "1"]
        data = [f for pattern, flags in SHRINK if re.search(pattern, cmd.text) for f in flags]
        return [*epochs, "--stop_after", "1", "--quiet", *out, *data]
    if cmd.verb.startswith("bench "):  # one timed run of a small batch
        return ["--runs", "1", "--warmup", "0", "--quiet", "--batch-size", "2"]
    if cmd.verb == "analyze memory":  # the estimate and the measured peak of one small batch
        return ["--batch-size", "2"]
    if cmd.verb == "analyze timings":  # Table 1 is a median of >= 50 runs
        return ["--runs", "50", "--warmup", "0"]
    if cmd.verb in ("analyze pooled-queries", "analyze window-study"):
        return ["--runs", "1", "--warmup", "0"]
    return []


def check_result(cmd: DocCommand, words: list[str], code: int, output: str) -> None:
    shown = " ".join(words)
    assert code == 0, f"{cmd.where}: `{cmd.text}` exited {code} (ran as `{shown}`):\n{output[-4000:]}"
    assert "Traceback" not in output, f"{cmd.where}: `{cmd.text}` printed a traceback:\n{output[-4000:]}"


def blocks() -> dict[tuple[str, int], list[DocCommand]]:
    found: dict[tuple[str, int], list[DocCommand]] = {}
    for c in COMMANDS:
        found.setdefault((c.path, c.block), []).append(c)
    return found


BLOCKS = blocks()


# cheap verbs that are not cheap on these lines: the default test parses them, the slow test runs them
FAST_PARSE_ONLY: tuple[str, ...] = (
    r"^vitlab models$",  # profiles every registered model (20 s); test_readme's model-table check does too
)


def fast_mode(cmd: DocCommand, words: list[str]) -> str:
    """How the default test checks a line: 'run' in full, 'config' (``--print_config``), 'parse' (the parser
    only) or 'static' (a benchmark script's flags)."""
    if cmd.script:
        return "static"
    if any(re.search(pattern, cmd.text) for pattern in FAST_PARSE_ONLY):
        return "parse"
    if "--help" in words or cmd.verb in ("models", "info", "eval") or (
            cmd.verb == "predict" and flag_value(words, "--checkpoint")):
        return "run"
    return "config" if cmd.verb in ("train", "pretrain") else "parse"


def cmd_argv(words: list[str]) -> list[str]:
    """The arguments of ``vitlab``: after ``vitlab``, ``python -m vitlab`` or ``torchrun ... -m vitlab``."""
    return words[words.index("vitlab") + 1:]


# ---------------------------------------------------------------------------------------------- the tests


def test_commands_are_found_and_every_skip_entry_is_used():
    assert len(COMMANDS) > 100 and {c.path for c in COMMANDS} >= {"README.md", "docs/ssl.md", "docs/dense.md"}
    unused = [s.pattern for s in SKIPS if not any(re.search(s.pattern, c.text) for c in COMMANDS)]
    assert not unused, f"SKIPS entries that match no doc command any more (remove them): {unused}"


@pytest.mark.parametrize("cmd", COMMANDS, ids=lambda c: c.where)
def test_doc_command_parses(cmd: DocCommand, world: DocWorld, monkeypatch):
    skip = skip_of(cmd.text)
    if skip is not None and not skip.parses:
        pytest.skip(skip.reason)
    block = BLOCKS[(cmd.path, cmd.block)]
    for n, words in enumerate(cmd.expanded()):
        mode = fast_mode(cmd, words)
        if mode == "static":
            check_script_flags([str(ROOT / w) if w == cmd.script else w for w in words])
            continue
        if mode == "parse" or skip is not None:  # the parser checks no path: placeholders stay
            code, output = parse_vitlab(cmd_argv(words))
            check_result(cmd, words, code, output)
            continue
        cwd = world.workdir(f"fast-{cmd.path.replace('/', '-')}-{cmd.line}-{n}")
        words = substitute(words, cmd, block, world, cwd)
        # train / pretrain: the whole config built and printed; eval / predict as the model is built (tuning it
        # through vitlab.optimize, seconds of compiling, is the slow test's)
        extra = ["--print_config"] if mode == "config" else ["--no-optimize"] if cmd.verb in ("eval", "predict") else []
        monkeypatch.chdir(cwd)
        code, output = run_vitlab(cmd_argv(words) + extra)
        check_result(cmd, words, code, output)


@pytest.mark.slow
@pytest.mark.parametrize("key", list(BLOCKS), ids=lambda k: f"{k[0]}:{BLOCKS[k][0].line}")
def test_doc_block_runs(key: tuple[str, int], world: DocWorld, monkeypatch):
    block = BLOCKS[key]
    todo = [c for c in block if runnable(c)]
    if not todo:
        pytest.skip("; ".join(f"{c.where}: {skip_of(c.text).reason}" for c in block))
    cwd = world.workdir(f"slow-{key[0].replace('/', '-')}-{key[1]}")
    monkeypatch.chdir(cwd)
    made: dict[str, Path] = {}  # runs the block's own lines made, by kind: a later RUN of the block is theirs
    for cmd in todo:
        for words in cmd.expanded():
            words = substitute(words, cmd, block, world, cwd, made)
            if cmd.script:
                code, output = run_script(words, dict(cmd.env), cwd)
                check_result(cmd, words, code, output)
                continue
            resume = flag_value(words, "--resume")
            if resume:  # resume a copy: the tiny runs stay as they are
                copy = cwd / "resumed" / f"line{cmd.line}"
                shutil.copytree(resume, copy, symlinks=True)  # last, best: links into checkpoints/
                words = [str(copy) if w == resume else w for w in words]
            words = words + tiny_flags(cmd, words, cmd.line)
            start = time.perf_counter()
            with monkeypatch.context() as env:
                for key_, value in cmd.env:
                    env.setenv(key_, value)
                code, output = run_vitlab(cmd_argv(words))
            print(f"{cmd.where}: {time.perf_counter() - start:.1f} s  {' '.join(words)}")
            check_result(cmd, words, code, output)
            if makes_run(cmd):
                made[kind_of_task(task_of(cmd))] = cwd / flag_value(words, "--output_dir", "--output-dir")

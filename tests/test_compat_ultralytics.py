"""`emakit.compat.ultralytics` against its own reference and against the real Ultralytics.

The first half needs no Ultralytics: both formulas against a reference written from
Ultralytics' description (a walk over both state dicts per update), BatchNorm statistics,
``num_batches_tracked``, ``updates=``, ``enabled``, ``update_attr``, the trainer's
checkpoint, model changes and bad input.

The second half compares with Ultralytics itself: its ``ModelEMA`` after every update, its
checkpoints both ways, and its trainer (``yolo classify`` on a folder of generated images,
run twice: with its class, then with ours bound by the one documented line, and resumed
from each other's checkpoint). Importing Ultralytics changes process-wide state (it
replaces ``torch.save``, sets print options, filters warnings), so that half runs in child
processes (this file run as a script), offline (``YOLO_OFFLINE=1``, sockets refused), and
skips, naming why, where Ultralytics cannot be imported: ``python tools/install_peers.py``
installs it into ``.peers/`` beside a CPU torch.
"""

from __future__ import annotations

import copy
import functools
import importlib.util
import io
import math
import os
import pickle
import pickletools
import subprocess
import sys
import zipfile
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from emakit.compat import ultralytics as compat
from emakit.errors import EMAStateError, EMATypeError, EMAValueError

TESTS = Path(__file__).resolve().parent
SRC = TESTS.parent / "src"
FORMULAS = ["lerp", "mul_add"]


def make_net(dtype: torch.dtype = torch.float32) -> nn.Module:
    """A small YOLO-like block: convolutions, BatchNorm (running statistics and the integer
    ``num_batches_tracked``), a frozen convolution (as YOLO's DFL) and a non-persistent
    buffer, which is not in the state dict and so not averaged."""
    torch.manual_seed(0)
    net = nn.Sequential(
        nn.Conv2d(3, 8, 3, bias=False),
        nn.BatchNorm2d(8),
        nn.SiLU(),
        nn.Conv2d(8, 4, 1),
        nn.Conv2d(4, 4, 1, bias=False).requires_grad_(False),
    )
    net.register_buffer("scratch", torch.zeros(3), persistent=False)
    return net.to(dtype)


def train_step(net: nn.Module, opt: torch.optim.Optimizer, seed: int) -> None:
    torch.manual_seed(seed)
    dtype = next(net.parameters()).dtype
    net.train()
    net(torch.randn(2, 3, 6, 6, dtype=dtype)).float().pow(2).mean().backward()
    opt.step()
    opt.zero_grad()
    net.scratch.add_(1.0)  # a forward-written buffer outside the state dict


def optimizer(net: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD([p for p in net.parameters() if p.requires_grad], lr=0.1)


class Reference:
    """Ultralytics' ``ModelEMA`` as its documentation describes it, written independently:
    every update walks both state dicts and moves each floating entry of the copy, by
    ``lerp_`` (Ultralytics >= 8.4.103) or by ``v *= d; v += (1 - d) * m`` (earlier)."""

    def __init__(self, model: nn.Module, decay: float, tau: float, formula: str, updates=0):
        self.ema = copy.deepcopy(model).eval()
        self.decay, self.tau, self.formula, self.updates = decay, tau, formula, updates

    @torch.no_grad()
    def update(self, model: nn.Module) -> None:
        self.updates += 1
        d = self.decay * (1 - math.exp(-self.updates / self.tau))
        online = model.state_dict()
        for name, v in self.ema.state_dict().items():
            if not v.dtype.is_floating_point:
                continue
            if self.formula == "lerp":  # (Ultralytics' _foreach_lerp_ refuses two dtypes)
                v.lerp_(online[name].to(v.dtype), 1 - d)
            else:
                v *= d
                v += (1 - d) * online[name]


def assert_same(a: dict, b: dict, where: str = "") -> None:
    assert list(a) == list(b), where
    for k in a:
        assert a[k].dtype == b[k].dtype, (where, k)
        assert torch.equal(a[k], b[k]), (where, k, (a[k].double() - b[k].double()).abs().max())


# -- without Ultralytics --------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("formula", FORMULAS)
def test_bit_identical_to_the_formula_after_every_update(formula, dtype):
    nets = [make_net(dtype), make_net(dtype)]
    opts = [optimizer(n) for n in nets]
    ref = Reference(nets[0], 0.999, 20, formula)
    ours = compat.ModelEMA(nets[1], decay=0.999, tau=20, formula=formula)
    start = {k: v.clone() for k, v in ours.ema.state_dict().items()}
    for step in range(1, 31):
        for net, opt in zip(nets, opts, strict=True):
            train_step(net, opt, step)
        ref.update(nets[0])
        ours.update(nets[1])
        assert_same(ref.ema.state_dict(), ours.ema.state_dict(), f"update {step}")
        assert ours.updates == step
    state = ours.ema.state_dict()
    moved = {k for k in state if not torch.equal(state[k], start[k])}
    assert {"0.weight", "1.running_mean", "1.running_var", "3.bias"} <= moved
    assert "1.num_batches_tracked" not in moved  # kept as copied, as Ultralytics does
    assert int(nets[1].state_dict()["1.num_batches_tracked"]) == 30
    assert torch.equal(ours.ema.scratch, torch.zeros(3, dtype=dtype))  # not in the state dict


def test_the_decay_and_the_copy_are_ultralytics():
    net = make_net()
    ours = compat.ModelEMA(net, decay=0.9, tau=7)
    for n in (1, 2, 7, 1000):
        assert ours.decay(n) == 0.9 * (1 - math.exp(-n / 7))
    assert compat.ModelEMA(net).decay(2000) == 0.9999 * (1 - math.exp(-2000 / 2000))
    assert ours.ema is not net and not ours.ema.training and ours.enabled
    assert not any(p.requires_grad for p in ours.ema.parameters())
    assert any(p.requires_grad for p in net.parameters())  # the model is left alone
    assert_same(ours.ema.state_dict(), net.state_dict())
    ours.decay = lambda n: 0.25  # a schedule of one's own, as code written for Ultralytics does
    expected = {k: v.clone() for k, v in ours.ema.state_dict().items()}
    train_step(net, optimizer(net), 1)
    ours.update(net)
    for k, v in net.state_dict().items():
        if v.is_floating_point():
            expected[k].lerp_(v, 1 - 0.25)
    assert_same(expected, ours.ema.state_dict())


def test_importing_it_imports_no_peer():
    code = (
        "import sys, emakit.compat, emakit.compat.ultralytics\n"
        "print([m for m in sys.modules if m.split('.')[0] in "
        "('ultralytics', 'polars', 'cv2', 'torchvision')])"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(SRC), *sys.path])}  # .peers too
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert out.returncode == 0 and out.stdout.strip() == "[]", out.stdout + out.stderr


@pytest.mark.parametrize("formula", FORMULAS)
def test_updates_resume_the_ramp(formula):
    """``updates=`` at construction, and ``ema.updates = n`` as the trainer's resume does:
    the next update uses ``decay(n + 1)``."""
    nets = [make_net(), make_net()]
    opts = [optimizer(n) for n in nets]
    ref = Reference(nets[0], 0.99, 30, formula, updates=50)
    ours = compat.ModelEMA(nets[1], 0.99, 30, 50, formula=formula)
    for step in range(1, 6):
        if step == 3:
            ref.updates = ours.updates = 400
        for net, opt in zip(nets, opts, strict=True):
            train_step(net, opt, step)
        ref.update(nets[0])
        ours.update(nets[1])
        assert_same(ref.ema.state_dict(), ours.ema.state_dict(), f"update {step}")
    assert ours.updates == 403


def test_enabled_false_does_nothing():
    net = make_net()
    ours = compat.ModelEMA(net, decay=0.5, tau=1)
    net.names = {0: "a"}
    before = {k: v.clone() for k, v in ours.ema.state_dict().items()}
    ours.enabled = False
    train_step(net, optimizer(net), 1)
    ours.update(net)
    ours.update_attr(net)
    assert ours.updates == 0 and not hasattr(ours.ema, "names")
    assert_same(before, ours.ema.state_dict())
    ours.enabled = True
    ours.update(net)
    assert ours.updates == 1 and not torch.equal(before["0.weight"], ours.ema[0].weight)


class Wrapper(nn.Module):
    """A parallel wrapper as DDP is one: the model under ``.module``."""

    def __init__(self, module: nn.Module) -> None:
        super().__init__()
        self.module = module


def test_update_attr_copies_public_attributes_of_the_unwrapped_model():
    net = make_net()
    ours = compat.ModelEMA(Wrapper(net))
    net.names, net.nc, net.stride, net._private = {0: "a"}, 1, torch.tensor([8.0]), 1
    ours.update_attr(Wrapper(net), include=["names", "nc", "stride", "missing"])
    assert ours.ema.names == {0: "a"} and ours.ema.nc == 1 and ours.ema.stride is net.stride
    assert not hasattr(ours.ema, "_private") and not hasattr(ours.ema, "missing")
    net.yaml = {"nc": 1}
    ours.update_attr(net, exclude=("training",))  # every public attribute but those
    assert ours.ema.yaml == {"nc": 1} and not ours.ema.training
    ours.update_attr(net)  # as Ultralytics: the root module's training flag too
    assert ours.ema.training is net.training


@pytest.mark.parametrize("formula", FORMULAS)
def test_the_trainers_checkpoint_resumes_alike(formula, tmp_path):
    """The trainer saves ``{"ema": deepcopy(ema.ema).half(), "updates": ema.updates}`` and
    resumes with ``ema.ema.load_state_dict(ckpt["ema"].float().state_dict())`` and
    ``ema.updates = ckpt["updates"]``. The file holds nothing of emakit (it unpickles
    without it) and the resumed EMA keeps the reference's numbers."""
    nets = [make_net(), make_net()]
    opts = [optimizer(n) for n in nets]
    ref = Reference(nets[0], 0.99, 5, formula)
    ours = compat.ModelEMA(nets[1], decay=0.99, tau=5, formula=formula)
    for step in range(1, 4):
        for net, opt in zip(nets, opts, strict=True):
            train_step(net, opt, step)
        ref.update(nets[0])
        ours.update(nets[1])
    path = tmp_path / "last.pt"
    torch.save({"ema": copy.deepcopy(ours.ema).half(), "updates": ours.updates}, path)
    with zipfile.ZipFile(path) as z:
        pickled = b"".join(z.read(n) for n in z.namelist() if n.endswith(".pkl"))
    assert b"emakit" not in pickled
    ckpt = torch.load(path, weights_only=False)
    resumed = compat.ModelEMA(nets[1], decay=0.99, tau=5, formula=formula)
    resumed.ema.load_state_dict(ckpt["ema"].float().state_dict())
    resumed.updates = ckpt["updates"]
    ref.ema.load_state_dict(copy.deepcopy(ref.ema).half().float().state_dict())
    for step in range(4, 7):
        for net, opt in zip(nets, opts, strict=True):
            train_step(net, opt, step)
        ref.update(nets[0])
        resumed.update(nets[1])
        assert_same(ref.ema.state_dict(), resumed.ema.state_dict(), f"update {step}")
    assert resumed.updates == 6


@pytest.mark.parametrize("formula", FORMULAS)
def test_changes_to_the_model_and_the_copy_are_followed(formula):
    """``.half()``/``.float()`` of the copy (Ultralytics' validator calls ``.float()`` on
    it), a submodule replaced, and another module assigned to ``ema``: each update uses
    what is there, as Ultralytics' walk over the state dicts does."""
    nets = [make_net(), make_net()]
    opts = [optimizer(n) for n in nets]
    ref = Reference(nets[0], 0.9, 3, formula)
    ours = compat.ModelEMA(nets[1], decay=0.9, tau=3, formula=formula)

    def step(n: int, where: str) -> None:
        for net, opt in zip(nets, opts, strict=True):
            train_step(net, opt, n)
        ref.update(nets[0])
        ours.update(nets[1])
        assert_same(ref.ema.state_dict(), ours.ema.state_dict(), where)

    step(1, "start")
    ref.ema.half()
    ours.ema.half()
    step(2, "copy in float16")
    ref.ema.float()
    ours.ema.float()
    step(3, "back to float32")
    for net in (*nets, ref.ema, ours.ema):
        torch.manual_seed(9)
        net[3] = nn.Conv2d(8, 4, 1)
    opts = [optimizer(n) for n in nets]
    step(4, "a submodule replaced")
    ref.ema = copy.deepcopy(nets[0]).eval()
    ours.ema = copy.deepcopy(nets[1]).eval()
    step(5, "another copy assigned")


def test_pickles_and_deep_copies_and_goes_on_alike():
    net = make_net()
    ours = compat.ModelEMA(net, decay=0.9, tau=3)
    ours.update(net)
    for other in (pickle.loads(pickle.dumps(ours)), copy.deepcopy(ours)):
        assert other.updates == 1 and other.decay(5) == ours.decay(5)
        assert_same(other.ema.state_dict(), ours.ema.state_dict())
    buffer = io.BytesIO()
    torch.save(ours, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    train_step(net, optimizer(net), 1)
    ours.update(net)
    loaded.update(net)
    assert_same(loaded.ema.state_dict(), ours.ema.state_dict())


def test_a_distillation_models_teacher_is_not_copied():
    class Distill(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.student_model = make_net()
            self.teacher_model = make_net()

    model = Distill()
    ours = compat.ModelEMA(model, decay=0.5, tau=1)
    assert ours.ema.teacher_model is None and model.teacher_model is not None
    ref = Reference(model.student_model, 0.5, 1, "lerp")
    opt = optimizer(model.student_model)
    for step in range(1, 4):
        train_step(model.student_model, opt, step)
        ref.update(model.student_model)
        ours.update(model)  # the teacher's tensors are the model's only: not paired
        assert_same(ref.ema.state_dict(), ours.ema.student_model.state_dict(), f"{step}")


def test_bad_input_raises_emakit_errors_naming_it():
    net = make_net()
    with pytest.raises(EMATypeError, match=r"model must be a torch.nn.Module.*model=None"):
        compat.ModelEMA(None)  # type: ignore[arg-type]
    with pytest.raises(EMAValueError, match=r"decay must be .*\[0, 1\].*decay=1.5"):
        compat.ModelEMA(net, decay=1.5)
    with pytest.raises(EMATypeError, match=r"decay must be a real number.*decay='0.9'"):
        compat.ModelEMA(net, decay="0.9")  # type: ignore[arg-type]
    for tau in (0, -5, float("nan")):
        with pytest.raises(EMAValueError, match=r"tau must be .*\(0, inf\).*number of updates"):
            compat.ModelEMA(net, tau=tau)
    with pytest.raises(EMAValueError, match=r"updates must be >= 0, got updates=-1"):
        compat.ModelEMA(net, updates=-1)
    with pytest.raises(EMATypeError, match=r"updates must be an int, got updates=1.5"):
        compat.ModelEMA(net, updates=1.5)  # type: ignore[arg-type]
    with pytest.raises(EMAValueError, match=r"formula must be one of .*formula='fma'.*YOLOv5"):
        compat.ModelEMA(net, formula="fma")  # type: ignore[arg-type]
    ours = compat.ModelEMA(net)
    with pytest.raises(EMATypeError, match=r"updates must be an int, got updates=None"):
        ours.updates = None  # type: ignore[assignment]
    with pytest.raises(EMATypeError, match=r"ema must be a torch.nn.Module, got ema='x'"):
        ours.ema = "x"  # type: ignore[assignment]
    with pytest.raises(EMAStateError, match=r"3\.weight|3\.bias"):
        ours.update(nn.Sequential(nn.Conv2d(3, 8, 3, bias=False), nn.BatchNorm2d(8)))
    assert ours.updates == 0


# -- against Ultralytics, in child processes --------------------------------------------------


def formula_of(version: str) -> str:
    """The formula of an Ultralytics release: ``_foreach_lerp_`` from 8.4.103 on."""
    parts = tuple(int(p) for p in version.split(".")[:3] if p.isdigit())
    return "lerp" if parts >= (8, 4, 103) else "mul_add"


def child_env(tmp: Path) -> dict[str, str]:
    return {
        **os.environ,
        "PYTHONPATH": __import__("_peers").child_pythonpath(str(SRC), str(TESTS)),
        "YOLO_OFFLINE": "1",  # Ultralytics' own switch: no online checks, no downloads
        "YOLO_CONFIG_DIR": str(tmp / "config"),  # its settings file, not the user's
        "MPLBACKEND": "Agg",
    }


def run_child(tmp: Path, *args: str, timeout: int = 240) -> str:
    """Run ``child_<args[0]>(*args[1:])`` of this file in a fresh process; its output."""
    tmp.mkdir(parents=True, exist_ok=True)
    result = subprocess.run(
        [sys.executable, __file__, *args],
        cwd=tmp,
        env=child_env(tmp),
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert result.returncode == 0, (result.stdout[-3000:], result.stderr[-6000:])
    return result.stdout


@pytest.fixture(scope="module")
def ultralytics_probe(tmp_path_factory) -> tuple[str, str]:
    """The installed Ultralytics' version and what its trainer lacks here ("" if nothing);
    skips, saying why, where Ultralytics does not import."""
    if importlib.util.find_spec("ultralytics") is None:
        pytest.skip(
            "ultralytics is not installed: `python tools/install_peers.py` puts it in .peers/ "
            "beside a CPU torch"
        )
    tmp = tmp_path_factory.mktemp("probe")
    result = subprocess.run(
        [sys.executable, __file__, "probe"], cwd=tmp, env=child_env(tmp), capture_output=True,
        text=True, timeout=240,
    )  # fmt: skip
    if result.returncode != 0:
        why = (result.stderr.strip().splitlines() or ["?"])[-1]
        pytest.skip(f"ultralytics does not import here: {why}")
    version, trainer_lacks = result.stdout.splitlines()[-2:]
    return version, trainer_lacks


@pytest.fixture(scope="module")
def ultralytics_version(ultralytics_probe) -> str:
    return ultralytics_probe[0]


@pytest.mark.parametrize("check", ["numbers", "checkpoints", "bookkeeping"])
def test_same_as_ultralytics_modelema(ultralytics_version, check, tmp_path):
    """Each check compares with Ultralytics' ``ModelEMA`` in a child (see the ``child_*``
    functions below)."""
    run_child(tmp_path, check, formula_of(ultralytics_version))


def make_images(root: Path) -> Path:
    """A two-class image folder (``train/``, ``val/``) of 32x32 PNGs, made here."""
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(0)
    for split, count in (("train", 8), ("val", 4)):
        for c, name in enumerate(("dark", "light")):
            folder = root / split / name
            folder.mkdir(parents=True)
            for i in range(count):
                image = rng.integers(0, 128, (32, 32, 3), dtype=np.uint8) + 127 * c
                Image.fromarray(image.astype(np.uint8)).save(folder / f"{i}.png")
    return root


@pytest.mark.slow
def test_ultralytics_trainer_with_the_one_line(ultralytics_probe, tmp_path):
    """``yolo classify`` (yolo11n-cls.yaml, random weights, 2 epochs, CPU, offline) with
    Ultralytics' class, then with ours bound by the documented line: the float32 EMA after
    every epoch, ``updates``, the checkpoints' half-precision EMA and the final model are
    the same bits. Then each run is resumed from the other's epoch-0 checkpoint (theirs
    reads ours, ours reads theirs): the same bits again. No file holds anything of emakit."""
    version, trainer_lacks = ultralytics_probe
    if trainer_lacks:
        pytest.skip(trainer_lacks)
    data = make_images(tmp_path / "data")
    formula = formula_of(version)
    runs = {}
    for mode in ("theirs", "ours"):
        run_child(tmp_path / mode, "train", mode, formula, str(data), "")
        runs[mode] = torch.load(tmp_path / mode / "summary.pt", weights_only=True)
    for mode, other in (("theirs", "ours"), ("ours", "theirs")):
        start = tmp_path / other / "run" / "weights" / "epoch0.pt"
        run_child(tmp_path / f"resumed_{mode}", "train", mode, formula, str(data), str(start))
        runs[f"resumed_{mode}"] = torch.load(
            tmp_path / f"resumed_{mode}" / "summary.pt", weights_only=True
        )
    for mode, summary in runs.items():
        assert summary["network"] == [], (mode, summary["network"])
        kind = "emakit.compat.ultralytics" if mode.endswith("ours") else "ultralytics.utils"
        classes = summary["ema_class"]
        assert classes and all(k.startswith(kind) for k in classes), (mode, classes)
    for a, b in (("theirs", "ours"), ("resumed_theirs", "resumed_ours")):
        assert list(runs[a]) == list(runs[b])
        for key in runs[a]:
            if key.startswith(("epoch", "file")):
                assert runs[a][key]["updates"] == runs[b][key]["updates"], (a, key)
                assert_same(runs[a][key]["state"], runs[b][key]["state"], f"{a} {key}")
    assert runs["theirs"]["epoch 1"]["updates"] == 8  # 2 epochs of 4 optimizer steps
    assert runs["resumed_theirs"]["epoch 1"]["updates"] == 8
    first, last = runs["theirs"]["epoch 0"]["state"], runs["theirs"]["epoch 1"]["state"]
    assert any(not torch.equal(first[k], last[k]) for k in first)  # the EMA moved
    for path in tmp_path.rglob("*.pt"):
        if "summary" not in path.name:
            with zipfile.ZipFile(path) as z:
                pickled = [z.read(n) for n in z.namelist() if n.endswith(".pkl")]
            # no class of emakit's is pickled (the file's text, e.g. the git commit message
            # Ultralytics stores, may say anything)
            modules = set().union(*map(pickled_modules, pickled))
            assert modules and not any(m.split(".")[0] == "emakit" for m in modules), path


def pickled_modules(data: bytes) -> set[str]:
    """The modules whose names a pickle imports (GLOBAL, and STACK_GLOBAL's module string)."""
    found, strings = set(), []
    for op, arg, _ in pickletools.genops(data):
        if op.name == "GLOBAL":
            found.add(arg.split(" ")[0])
        elif op.name == "STACK_GLOBAL":
            found.add(strings[-2])
        elif isinstance(arg, str):
            strings.append(arg)
    return found


# -- what the children run (this file as a script, Ultralytics importable) ------------------


def refuse_network() -> list[str]:
    """Make every socket connection and name lookup fail, recording what was tried."""
    import socket

    tried: list[str] = []

    def refuse(what: str) -> Any:
        def call(*args: Any, **kwargs: Any) -> Any:
            tried.append(f"{what}{args[1:] if what == 'connect' else args[:1]}")
            raise OSError("the network is off in this test")

        return call

    socket.socket.connect = refuse("connect")  # type: ignore[method-assign]
    socket.socket.connect_ex = refuse("connect")  # type: ignore[method-assign]
    socket.getaddrinfo = refuse("getaddrinfo")
    socket.create_connection = refuse("create_connection")
    return tried


def child_probe() -> None:
    """Import what the checks use; print the version, then what the trainer lacks."""
    import ultralytics
    import ultralytics.engine.trainer
    import ultralytics.utils.torch_utils

    print(ultralytics.__version__)
    try:
        import polars  # noqa: F401  (the trainer writes results.csv with it)
    except ImportError as e:
        print(f"{e} (the trainer needs polars; tools/install_peers.py installs it)")
    else:
        print("")


def yolo_loss(output: Any) -> torch.Tensor:
    """A loss over whatever a YOLO model returns in train mode (tensors, nested)."""
    if isinstance(output, torch.Tensor):
        return output.float().pow(2).mean()
    items = output.values() if isinstance(output, dict) else output
    return sum((yolo_loss(o) for o in items), torch.zeros(()))


def child_numbers(formula: str) -> None:
    """After every update, the same state dict as Ultralytics' ``ModelEMA``: the small
    model in float32 and float16, and a real YOLO11n detection model (its DFL is frozen)."""
    from ultralytics.nn.tasks import DetectionModel
    from ultralytics.utils.torch_utils import ModelEMA

    for dtype in (torch.float32, torch.float16):
        nets = [make_net(dtype), make_net(dtype)]
        opts = [optimizer(n) for n in nets]
        theirs = ModelEMA(nets[0], decay=0.999, tau=20)
        ours = compat.ModelEMA(nets[1], decay=0.999, tau=20, formula=formula)
        for step in range(1, 31):
            for net, opt in zip(nets, opts, strict=True):
                train_step(net, opt, step)
            theirs.update(nets[0])
            ours.update(nets[1])
            assert_same(theirs.ema.state_dict(), ours.ema.state_dict(), f"{dtype} {step}")
            assert (theirs.updates, theirs.decay(step)) == (ours.updates, ours.decay(step))
    torch.manual_seed(0)
    nets = [DetectionModel("yolo11n.yaml", nc=3, verbose=False) for _ in range(2)]
    nets[1].load_state_dict(nets[0].state_dict())
    theirs, ours = ModelEMA(nets[0]), compat.ModelEMA(nets[1], formula=formula)
    opts = [optimizer(n) for n in nets]
    for step in range(1, 4):
        for net, opt in zip(nets, opts, strict=True):
            torch.manual_seed(step)
            net.train()
            yolo_loss(net(torch.randn(2, 3, 64, 64))).backward()
            opt.step()
            opt.zero_grad()
        theirs.update(nets[0])
        ours.update(nets[1])
        assert_same(theirs.ema.state_dict(), ours.ema.state_dict(), f"yolo11n {step}")


def child_checkpoints(formula: str) -> None:
    """The trainer's checkpoint both ways: Ultralytics' file resumed by ours and ours by
    Ultralytics', each then in step with an uninterrupted Ultralytics EMA resumed alike."""
    from ultralytics.utils.torch_utils import ModelEMA

    classes = {"theirs": ModelEMA, "ours": functools.partial(compat.ModelEMA, formula=formula)}
    for writer, reader in (("theirs", "ours"), ("ours", "theirs")):
        nets = [make_net(), make_net()]
        opts = [optimizer(n) for n in nets]
        ref, ema = ModelEMA(nets[0], 0.99, 5), classes[writer](nets[1], 0.99, 5)
        for step in range(1, 4):
            for net, opt in zip(nets, opts, strict=True):
                train_step(net, opt, step)
            ref.update(nets[0])
            ema.update(nets[1])
        buffer = io.BytesIO()
        torch.save({"ema": copy.deepcopy(ema.ema).half(), "updates": ema.updates}, buffer)
        buffer.seek(0)
        ckpt = torch.load(buffer, weights_only=False)
        resumed = classes[reader](nets[1], 0.99, 5)
        resumed.ema.load_state_dict(ckpt["ema"].float().state_dict())
        resumed.updates = ckpt["updates"]
        ref.ema.load_state_dict(copy.deepcopy(ref.ema).half().float().state_dict())
        for step in range(4, 8):
            for net, opt in zip(nets, opts, strict=True):
                train_step(net, opt, step)
            ref.update(nets[0])
            resumed.update(nets[1])
            assert_same(ref.ema.state_dict(), resumed.ema.state_dict(), f"{writer} {step}")
        assert resumed.updates == ref.updates == 7


def child_bookkeeping(formula: str) -> None:
    """``updates=``, ``enabled=False`` and ``update_attr`` as Ultralytics' class, and the
    same signature."""
    import inspect

    from ultralytics.utils.torch_utils import ModelEMA

    ours_params = inspect.signature(compat.ModelEMA).parameters.values()
    shared = [(p.name, p.default) for p in ours_params if p.kind is not p.KEYWORD_ONLY]
    assert shared == [(p.name, p.default) for p in inspect.signature(ModelEMA).parameters.values()]
    ours_attr = inspect.signature(compat.ModelEMA.update_attr).parameters
    for name, p in inspect.signature(ModelEMA.update_attr).parameters.items():
        assert ours_attr[name].default == p.default, name
    nets = [make_net(), make_net()]
    opts = [optimizer(n) for n in nets]
    theirs = ModelEMA(nets[0], 0.99, 30, 120)
    ours = compat.ModelEMA(nets[1], 0.99, 30, 120, formula=formula)
    expected = 120
    for step in range(1, 7):
        enabled = step not in (2, 3)
        theirs.enabled = ours.enabled = enabled
        expected += enabled
        for net, opt in zip(nets, opts, strict=True):
            train_step(net, opt, step)
            net.names, net.nc, net._hidden = {0: str(step)}, step, step
        theirs.update(nets[0])
        ours.update(nets[1])
        theirs.update_attr(Wrapper(nets[0]), include=["names", "nc", "stride"])
        ours.update_attr(Wrapper(nets[1]), include=["names", "nc", "stride"])
        assert_same(theirs.ema.state_dict(), ours.ema.state_dict(), f"update {step}")
        assert theirs.updates == ours.updates == expected
        for name in ("names", "nc", "_hidden", "stride"):
            assert getattr(theirs.ema, name, None) == getattr(ours.ema, name, None), name
    theirs.update_attr(nets[0])
    ours.update_attr(nets[1])
    public = {k for k in vars(nets[0]) if not k.startswith("_")}
    for name in public:
        assert (getattr(theirs.ema, name) == getattr(ours.ema, name)) is True, name


def child_train(mode: str, formula: str, data: str, start: str) -> None:
    """One run of Ultralytics' trainer (``start``: the checkpoint to resume), with its
    ``ModelEMA`` (``mode="theirs"``) or ours bound by the documented line; writes
    ``summary.pt``: the float32 EMA at the end of every epoch, the EMA and ``updates`` of
    every checkpoint, the final model, and any network access tried."""
    import shutil

    tried = refuse_network()
    import ultralytics.engine.trainer

    if mode == "ours":
        ours = functools.partial(compat.ModelEMA, formula=formula)
        ultralytics.engine.trainer.ModelEMA = ours if formula == "mul_add" else compat.ModelEMA
    from ultralytics import YOLO

    out = Path.cwd()
    summary: dict[str, Any] = {"ema_class": set()}

    def record(trainer: Any) -> None:
        summary["ema_class"].add(f"{type(trainer.ema).__module__}.{type(trainer.ema).__name__}")
        if trainer.epoch < trainer.epochs:  # not the final validation's call
            state = {k: v.clone() for k, v in trainer.ema.ema.state_dict().items()}
            summary[f"epoch {trainer.epoch}"] = {"state": state, "updates": trainer.ema.updates}

    if start:
        shutil.copy(start, out / "start.pt")
        model = YOLO(str(out / "start.pt"))
        model.add_callback("on_fit_epoch_end", record)
        model.train(resume=True, save_dir=str(out / "run"))
    else:
        model = YOLO("yolo11n-cls.yaml")
        model.add_callback("on_fit_epoch_end", record)
        model.train(
            data=data, epochs=2, imgsz=32, batch=4, nbs=4, workers=0, device="cpu", amp=False,
            plots=False, seed=0, deterministic=True, save_period=1, project=str(out),
            name="run", exist_ok=True, verbose=False,
        )  # fmt: skip
    for path in sorted((out / "run" / "weights").glob("*.pt")):
        ckpt = torch.load(path, weights_only=False)
        saved = ckpt["ema"] if ckpt.get("ema") is not None else ckpt["model"]
        summary[f"file {path.name}"] = {"state": saved.state_dict(), "updates": ckpt["updates"]}
    summary["ema_class"] = sorted(summary["ema_class"])
    summary["network"] = list(tried)
    torch.save(summary, out / "summary.pt")


if __name__ == "__main__":
    import _peers

    _peers.allow_timm()  # Ultralytics and its torchvision in .peers/ (see tests/_peers.py)
    torch.set_num_threads(1)  # the parent and its neighbours keep the other cores
    globals()[f"child_{sys.argv[1]}"](*sys.argv[2:])

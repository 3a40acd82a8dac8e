"""Shared test fixtures: the reference fixtures' location, the fixture cases and the flax
models their official constructors describe, a prepared digits data dir."""

import atexit
import dataclasses
import importlib.util
import json
import os
import pathlib
import re
import shutil
import subprocess
import sys
import tempfile

import numpy as np
import pytest

REPO = pathlib.Path(__file__).resolve().parents[1]
# The suite is dominated by XLA compilation of tiny models: LLVM's backend optimisations
# cost more time than they save here, and XLA:CPU's older loop emitters compile these steps
# with 40% less CPU time than its MLIR fusion emitters (docs/testing.md, "How the tests run JAX"); set before
# JAX starts, subprocesses get them too.
FAST_COMPILE = (
    "--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true"
    " --xla_cpu_use_fusion_emitters=false"
)
os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {FAST_COMPILE}".strip()
# The test requirements install libtpu (the TPU compiler, tests/test_tpu_compile.py): every
# test process runs on the CPU rather than starting libtpu as a backend, and the processes
# share libtpu's compiler instead of taking its one lock per machine in turn.
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
os.environ.setdefault("TPU_ACCELERATOR_TYPE", "v5litepod-8")
os.environ.setdefault("TPU_WORKER_HOSTNAMES", "localhost")
# Many tests (and their subprocesses) compile the same small programs again: one persistent
# compilation cache for the whole run lets them load what another test compiled. With it, the
# steps take jaxlib's default products on CPU, which the cache can store (`ops.compiler_options`);
# the tests of oneDNN's products choose them explicitly. It is made by
# the first process that imports this file (pytest-xdist's controller, whose workers and
# subprocesses inherit the variable) and removed when that process exits.
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
    os.environ["JAX_COMPILATION_CACHE_DIR"] = tempfile.mkdtemp(prefix="rspc_jax_test_xla_cache_")
    os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
    atexit.register(shutil.rmtree, os.environ["JAX_COMPILATION_CACHE_DIR"], ignore_errors=True)
# The reference fixtures (docs/testing.md, "Reference fixtures and skips"): by default
# tests/fixtures/reference, written by reference/make_fixtures.py; the environment variable
# RSPC_JAX_FIXTURES names another folder (e.g. a nonexistent one, to check that every parity
# test then skips with its reason). The full-size key manifests are read from the sibling
# folder FIXTURES.parent / "torch_keys".
FIXTURES_ENV = "RSPC_JAX_FIXTURES"
FIXTURES = pathlib.Path(
    os.environ.get(FIXTURES_ENV) or REPO / "tests" / "fixtures" / "reference"
).expanduser()


def fixture_dir(case: str) -> pathlib.Path:
    path = FIXTURES / case
    if not path.is_dir():
        pytest.skip(f"reference fixture {path} is not available")
    return path


def fixture_cases(kind: str) -> list:
    """The names of index.json's cases of `kind`, for `pytest.mark.parametrize` (or fixture
    params). Without the index (or a case of that kind) it returns one parameter that is
    skipped with the reason, so that the tests skip visibly instead of failing to collect."""
    index = FIXTURES / "index.json"
    if not index.is_file():
        reason = f"reference fixtures not found at {index}"
    else:
        cases = json.loads(index.read_text())["cases"]
        names = [case["name"] for case in cases if case["kind"] == kind]
        if names:
            return names
        reason = f"no reference fixture of kind {kind!r} in {index}"
    return [pytest.param(None, id=f"no-{kind}-fixtures", marks=pytest.mark.skip(reason=reason))]


@dataclasses.dataclass(frozen=True)
class FixtureCase:
    """One reference case: its folder, config.json and the arrays of inputs/outputs.npz."""

    name: str
    path: pathlib.Path
    config: dict
    inputs: dict
    outputs: dict

    @property
    def image_shape(self) -> tuple[int, int, int]:
        """(H, W, C) of the case's input images."""
        return tuple(self.inputs["x_nhwc"].shape[1:])

    def state_dict(self, spec: dict | None = None, default: str = "state_dict.npz") -> str:
        """The state dict file of a model described by `spec` (its `state_dict_file`, whose
        first word is the file name), else `default`; as a path string."""
        name = (spec or {}).get("state_dict_file", default).split()[0]
        return str(self.path / name)


def load_case(case: str, kind: str) -> FixtureCase:
    """The reference case `case` (skipped when its folder is absent), checked to be of `kind`."""
    path = fixture_dir(case)
    config = json.loads((path / "config.json").read_text())
    assert config["kind"] == kind, f"{case} is a {config['kind']} case, not {kind}"
    with np.load(path / "inputs.npz") as inputs, np.load(path / "outputs.npz") as outputs:
        return FixtureCase(case, path, config, dict(inputs), dict(outputs))


# ------------------------------------------------------------------------------------------
# Flax models from the official constructors' arguments (config.json "constructor" or, for an
# rspc_loss case, "classifier"/"occlusion_model"): every keyword argument the official callable
# accepts is either mapped, checked to have no effect on the computation, or rejected.

_REQUIRED = object()
# RSPC_RVT/robust_models.py PoolingTransformer.__init__.
RVT_SIGNATURE = dict(
    image_size=_REQUIRED,
    patch_size=_REQUIRED,
    stride=_REQUIRED,
    base_dims=_REQUIRED,
    depth=_REQUIRED,
    heads=_REQUIRED,
    mlp_ratio=_REQUIRED,
    num_classes=1000,
    in_chans=3,
    attn_drop_rate=0.0,
    drop_rate=0.0,
    drop_path_rate=0.0,
    use_mask=False,
    masked_block=None,
    pretrained_cfg=None,
)
# RSPC_FAN/models/fan.py FAN.__init__ (`backbone` is config.json's separate entry).
FAN_SIGNATURE = dict(
    img_size=224,
    patch_size=16,
    in_chans=3,
    num_classes=1000,
    embed_dim=768,
    depth=12,
    sharpen_attn=False,
    channel_dims=None,
    num_heads=12,
    mlp_ratio=4.0,
    qkv_bias=True,
    drop_rate=0.0,
    attn_drop_rate=0.0,
    drop_path_rate=0.0,
    sr_ratio=None,
    use_checkpoint=False,
    act_layer=None,
    norm_layer=None,
    se_mlp=False,
    cls_attn_layers=2,
    use_pos_embed=True,
    eta=1.0,
    tokens_norm=False,
    c_head_num=None,
    hybrid_patch_size=2,
    head_init_scale=1.0,
)
# RSPC_FAN/models/convnext_utils.py _create_hybrid_backbone(variant, pretrained, **kwargs) ->
# timm build_model_with_cfg(ConvNeXt, variant, pretrained, pretrained_strict=..., **kwargs).
CONVNEXT_SIGNATURE = dict(
    variant="convnext_base_in22k",
    pretrained=False,
    pretrained_strict=True,
    pretrained_cfg=None,
    features_only=False,
    in_chans=3,
    img_size=224,
    num_classes=1000,
    global_pool="avg",
    output_stride=32,
    patch_size=4,
    depths=(3, 3, 9, 3),
    dims=(96, 192, 384, 768),
    ls_init_value=1e-6,
    conv_mlp=True,
    use_head=True,
    head_init_scale=1.0,
    head_norm_first=False,
    norm_layer=None,
    drop_rate=0.0,
    drop_path_rate=0.0,
    remove_last_downsample=False,
)
# RSPC_RVT/robust_models.py PatchOcclusion.__init__ (positional).
PATCH_OCCLUSION_ARGS = ("mask_ratio", "in_chans", "patch_size", "num_patches")
# README: target_type 'hard' is LabelSmoothingCrossEntropy(0.1) on the integer labels.
HARD_TARGET_SMOOTHING = 0.1
DEFAULT_RSPC_LAMBDA = 0.005  # the official --extra_weight (RSPC-RVT / RSPC-FAN recipes)


def _official_kwargs(callable_name: str, kwargs: dict, signature: dict) -> dict:
    """`kwargs` completed with the official defaults; rejects unknown or missing arguments."""
    unknown = sorted(set(kwargs) - set(signature))
    assert not unknown, f"{callable_name}: unsupported keyword arguments {unknown}"
    merged = {**signature, **kwargs}
    missing = sorted(k for k, v in merged.items() if v is _REQUIRED)
    assert not missing, f"{callable_name}: required arguments {missing} not given"
    return merged


def _pair(value) -> tuple[int, int]:
    return tuple(value) if isinstance(value, list | tuple) else (value, value)


def _only_in_train(name: str, kwargs: dict, keys, *, train: bool, what: str) -> None:
    """Rates that act in train mode only: eval-mode outputs do not depend on them."""
    if train:
        for key in keys:
            assert kwargs[key] == 0, f"{name}: {key}={kwargs[key]} is not supported ({what})"


def official_model(spec: dict, image_shape, *, train: bool = False):
    """The flax model of an official constructor spec ({"callable", "kwargs"[, "backbone"]}),
    for images of `image_shape` (H, W, C); `train`: the case runs the model in train mode."""
    name = spec["callable"]
    if name == "PoolingTransformer":
        return _official_rvt(spec["kwargs"], image_shape, train)
    if name == "FAN":
        return _official_fan(spec["kwargs"], spec.get("backbone"), image_shape, train)
    raise AssertionError(f"no flax model for the official callable {name!r}")


def _official_rvt(kwargs: dict, image_shape, train: bool):
    """PoolingTransformer(**kwargs) -> rvt.RVT. patch_size and stride are unused by the
    official model (its conv stem is fixed at stride 16); image_size only sets an unused
    width, but its PAAS masks are made for the 224 px token grid."""
    from rspc_jax.models import rvt

    kw = _official_kwargs("PoolingTransformer", kwargs, RVT_SIGNATURE)
    height, width, channels = image_shape
    assert kw["image_size"] == height == width, f"image_size {kw['image_size']} != {image_shape}"
    assert kw["in_chans"] == channels, f"in_chans {kw['in_chans']} != {channels}"
    assert kw["num_classes"] > 0, "a head-less PoolingTransformer (num_classes 0) is not supported"
    if kw["use_mask"]:
        assert kw["masked_block"] is not None, "use_mask needs masked_block (official assert)"
    if train:
        assert kw["attn_drop_rate"] == kw["drop_rate"], (
            "rvt.RVT has one dropout rate for drop_rate and attn_drop_rate"
        )
    return rvt.RVT(
        num_classes=kw["num_classes"],
        base_dims=tuple(kw["base_dims"]),
        depth=tuple(kw["depth"]),
        heads=tuple(kw["heads"]),
        mlp_ratio=kw["mlp_ratio"],
        masked_block=kw["masked_block"] if kw["use_mask"] else 0,
        drop_path_rate=kw["drop_path_rate"],
        dropout=kw["drop_rate"],
    )


def _official_fan(kwargs: dict, backbone: dict | None, image_shape, train: bool):
    """FAN(backbone=_create_hybrid_backbone(**backbone.kwargs), **kwargs) -> fan.FAN (FAN-ViT
    without a backbone). FAN never forwards sharpen_attn to its blocks, TokenMixing stores
    sr_ratio without using it, and use_checkpoint / head_init_scale do not change outputs."""
    from rspc_jax.models import fan

    kw = _official_kwargs("FAN", kwargs, FAN_SIGNATURE)
    height, width, channels = image_shape
    assert _pair(kw["img_size"]) == (height, width), f"img_size {kw['img_size']} != {image_shape}"
    assert kw["in_chans"] == channels, f"in_chans {kw['in_chans']} != {channels}"
    assert kw["num_classes"] > 0, "a head-less FAN (num_classes 0) is not supported"
    depth, dim = kw["depth"], kw["embed_dim"]
    heads = kw["num_heads"]
    if isinstance(heads, list):  # official: per-block heads; class attention uses heads[-1]
        assert len(set(heads)) == 1, f"fan.FAN has one head count, got num_heads {heads}"
        heads = heads[0]
    if kw["channel_dims"] is not None:  # official: per-block widths with downsampling between
        assert set(kw["channel_dims"]) == {dim}, f"channel_dims {kw['channel_dims']} != {dim}"
    assert kw["sr_ratio"] is not None and len(kw["sr_ratio"]) >= depth, (
        f"FAN indexes sr_ratio[i] for each of its {depth} blocks, got {kw['sr_ratio']}"
    )
    if kw["c_head_num"] is not None:  # ChannelProcessing heads = c_head_num[i] or num_heads
        assert all((c or heads) == heads for c in kw["c_head_num"][:depth]), (
            f"fan.FAN has no separate channel-processing head count (c_head_num {kw['c_head_num']})"
        )
    for key, supported in (("se_mlp", False), ("use_pos_embed", True)):
        assert kw[key] == supported, f"FAN: {key}={kw[key]} is not supported"
    for key in ("act_layer", "norm_layer"):
        assert kw[key] is None, f"FAN: {key}={kw[key]} is not supported"
    assert kw["eta"] is not None, "FAN blocks need a layer-scale init eta"
    _only_in_train("FAN", kw, ("drop_rate", "attn_drop_rate"), train=train, what="no dropout")
    stem = {}
    if backbone is None:
        assert kw["patch_size"] == 16, "fan.FAN builds the FAN-ViT conv stem for patch 16 only"
        stem["hybrid"] = False
    else:
        assert backbone["callable"] == "_create_hybrid_backbone", backbone["callable"]
        b = _official_kwargs("_create_hybrid_backbone", backbone["kwargs"], CONVNEXT_SIGNATURE)
        for key, supported in (
            ("features_only", False),
            ("in_chans", channels),
            ("output_stride", 32),
            ("patch_size", 4),
            ("conv_mlp", True),
            ("use_head", False),
            ("head_norm_first", False),
            ("norm_layer", None),
            ("remove_last_downsample", False),
        ):
            assert b[key] == supported, f"hybrid ConvNeXt: {key}={b[key]} is not supported"
        assert b["ls_init_value"] > 0, "hybrid ConvNeXt: blocks without layer scale (gamma)"
        _only_in_train(
            "hybrid ConvNeXt", b, ("drop_path_rate",), train=train, what="no stochastic depth"
        )
        depths = tuple(b["depths"])
        assert len(b["dims"]) >= len(depths), f"dims {b['dims']} for depths {depths}"
        stem.update(hybrid=True, stem_depths=depths, stem_dims=tuple(b["dims"][: len(depths)]))
    return fan.FAN(
        num_classes=kw["num_classes"],
        embed_dim=dim,
        depth=depth,
        num_heads=heads,
        mlp_ratio=kw["mlp_ratio"],
        qkv_bias=kw["qkv_bias"],
        hybrid_patch_size=kw["hybrid_patch_size"],
        cls_attn_layers=kw["cls_attn_layers"],
        tokens_norm=kw["tokens_norm"],
        eta=kw["eta"],
        head_init_scale=kw["head_init_scale"],
        drop_path_rate=kw["drop_path_rate"],
        **stem,
    )


def official_corruption(spec: dict, image_shape):
    """PatchOcclusion(*args) -> (rspc.PatchCorruptionModel, rho); rho = mask_ratio % 1 as the
    official module takes it. Its Dense is N x N with N read from the input, so num_patches
    and in_chans must match the images."""
    from rspc_jax import rspc

    assert spec["callable"] == "PatchOcclusion", spec["callable"]
    names = tuple(spec.get("arg_names", PATCH_OCCLUSION_ARGS))
    assert names == PATCH_OCCLUSION_ARGS[: len(names)], f"PatchOcclusion arguments {names}"
    args = dict(zip(names, spec.get("args", ())), **spec.get("kwargs", {}))
    assert set(args) == set(PATCH_OCCLUSION_ARGS), f"PatchOcclusion arguments {sorted(args)}"
    height, width, channels = image_shape
    patch = args["patch_size"]
    assert args["in_chans"] == channels, f"in_chans {args['in_chans']} != {channels}"
    assert height % patch == 0 and width % patch == 0, f"patch {patch} for {image_shape}"
    assert args["num_patches"] == (height // patch) * (width // patch), (
        f"num_patches {args['num_patches']} != the {height // patch}x{width // patch} patch grid"
    )
    return rspc.PatchCorruptionModel(patch_size=patch), args["mask_ratio"] % 1


def criterion_targets(case: FixtureCase) -> np.ndarray:
    """The (B, K) target distribution for our soft-target CE that reproduces the case's
    criterion: 'soft' gives `targets` to SoftTargetCrossEntropy; 'hard' gives `labels` to
    LabelSmoothingCrossEntropy(s), which is the CE against the smoothed one-hot distribution
    (1 - s + s/K on the label, s/K elsewhere) that `targets` then holds (checked here)."""
    target_type = case.config["target_type"]
    targets = case.inputs["targets"]
    if target_type == "soft":
        return targets
    assert target_type == "hard", f"unknown target_type {target_type!r}"
    criterion = case.config.get("loss", {}).get("criterion", "")
    found = re.search(r"LabelSmoothingCrossEntropy\((?:smoothing=)?([0-9.eE+-]+)\)", criterion)
    smoothing = float(found.group(1)) if found else HARD_TARGET_SMOOTHING
    num_classes = targets.shape[1]
    expected = np.full(targets.shape, smoothing / num_classes)
    expected[np.arange(len(targets)), case.inputs["labels"]] += 1.0 - smoothing
    assert_close(targets, expected, 1e-6, "targets (smoothed one-hot labels)")
    return targets


def torch_keys_manifest(name: str) -> dict:
    """The official PyTorch key/shape manifest of full-size model `name`."""
    path = FIXTURES.parent / "torch_keys" / f"{name}.json"
    if not path.is_file():
        pytest.skip(f"reference key manifest {path} is not available")
    return json.loads(path.read_text())


def assert_close(ours, ref, tol: float, name: str) -> None:
    """Parity check against a reference array: same shape, max abs error <= tol."""
    ref = np.asarray(ref)
    assert np.shape(ours) == ref.shape, f"{name}: shape {np.shape(ours)} != {ref.shape}"
    err = float(np.max(np.abs(np.asarray(ours, np.float64) - ref)))
    print(f"{name}: max abs error {err:.3g} (tolerance {tol:.3g})")  # shown with pytest -s
    assert err <= tol, f"{name}: max abs error {err:.3g} > {tol:.3g}"


def assert_trees_equal(ours, ref) -> None:
    """Same tree structure and bitwise equal leaves."""
    import jax

    assert jax.tree.structure(ours) == jax.tree.structure(ref)
    for a, b in zip(jax.tree.leaves(ours), jax.tree.leaves(ref)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def activation_tol(ref) -> float:
    """The fixtures' tolerance for activations: 1e-4 * max(1, max |ref|)."""
    return 1e-4 * max(1.0, float(np.abs(ref).max()))


@pytest.fixture(scope="session")
def digits_data_dir(tmp_path_factory) -> str:
    """The embedded digits dataset, prepared once per session (no network)."""
    from rspc_jax.data import records

    data_dir = str(tmp_path_factory.mktemp("tfds"))
    records.get_builder("sklearn_digits", data_dir)
    return data_dir


@pytest.fixture(scope="session")
def demo_run(digits_data_dir, tmp_path_factory):
    """configs/demo.py:smoke through `python -m rspc_jax.main` as the README runs it (a
    relative workdir), with an EMA; (workdir, CompletedProcess), run once per session."""
    cwd = tmp_path_factory.mktemp("demo_run")
    result = run_python(
        [
            "-m",
            "rspc_jax.main",
            f"--config={REPO}/configs/demo.py:smoke",
            "--workdir=demo",
            f"--config.data_dir={digits_data_dir}",
            "--config.ema_decay=0.9",
        ],
        timeout=300,
        cwd=cwd,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return cwd / "demo", result


def load_config(path: pathlib.Path, arg=None):
    """A config file's module and its `get_config(arg)`."""
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module, module.get_config(arg)


def smoke_config(data_dir: str, **overrides):
    """configs/demo.py:smoke with overrides given as dotted keys."""
    _, config = load_config(REPO / "configs" / "demo.py", "smoke")
    config.data_dir = data_dir
    for key, value in overrides.items():
        node = config
        *parents, leaf = key.split(".")
        for p in parents:
            node = node[p]
        node[leaf] = value
    return config


def first_batches(config, count: int = 1) -> list:
    """The first `count` training batches of `config`'s data, unaugmented, seed 0."""
    from rspc_jax.data import train as train_data

    iterator = train_data.train_iterator(
        dataset=config.dataset,
        data_dir=config.data_dir,
        split="train",
        image_size=config.image_size,
        local_batch_size=config.batch_size,
        seed=0,
        augment="none",
    )
    return [next(iterator) for _ in range(count)]


def random_erasing_before(image, key, prob, min_area=0.02, max_area=1 / 3, min_aspect=0.3):
    """timm's random erasing as the host pipeline ran it before the accelerator filled the
    box (and before it skipped the images it does not erase): the oracle of the box draws,
    on a normalised float32 image, keyed by a TF stateless key."""
    import math

    import tensorflow as tf

    coin_key, shape_key, top_key, left_key, noise_key = tf.unstack(
        tf.random.experimental.stateless_split(key, 5)
    )
    height, width = tf.shape(image)[0], tf.shape(image)[1]
    area = tf.cast(height * width, tf.float32)
    draws = tf.random.stateless_uniform([10, 2], shape_key)
    target = (min_area + (max_area - min_area) * draws[:, 0]) * area
    log_lo, log_hi = math.log(min_aspect), math.log(1 / min_aspect)
    aspect = tf.exp(log_lo + (log_hi - log_lo) * draws[:, 1])
    heights = tf.cast(tf.round(tf.sqrt(target * aspect)), tf.int32)
    widths = tf.cast(tf.round(tf.sqrt(target / aspect)), tf.int32)
    fits = (heights < height) & (widths < width)
    first = tf.argmax(tf.cast(fits, tf.int32), output_type=tf.int32)
    h, w = heights[first], widths[first]
    top = tf.random.stateless_uniform([], top_key, 0, tf.maximum(height - h, 0) + 1, dtype=tf.int32)
    left = tf.random.stateless_uniform(
        [], left_key, 0, tf.maximum(width - w, 0) + 1, dtype=tf.int32
    )
    erase = (tf.random.stateless_uniform([], coin_key) < prob) & tf.reduce_any(fits)
    h, w = h * tf.cast(erase, tf.int32), w * tf.cast(erase, tf.int32)
    noise = tf.random.stateless_normal([h, w, tf.shape(image)[2]], noise_key, dtype=image.dtype)
    noise = tf.pad(noise, [[top, height - top - h], [left, width - left - w], [0, 0]])
    rows, cols = tf.range(height)[:, None], tf.range(width)[None, :]
    inside = (rows >= top) & (rows < top + h) & (cols >= left) & (cols < left + w)
    return tf.where(inside[..., None], noise, image)


def system_tcmalloc() -> str:
    """The system's tcmalloc library; skips the test where it is not installed."""
    from rspc_jax.tools import allocator

    library = allocator.find_tcmalloc()
    if library is None:
        pytest.skip("this system has no tcmalloc (Debian/Ubuntu: apt install libtcmalloc-minimal4)")
    return library


def skip_without(module: str) -> None:
    """Skips the test when `module` is not installed, without importing it: timm imports
    torchvision, whose triton import crashes a process that has already loaded JAX and
    TensorFlow (tests that need timm run it in a fresh process)."""
    if importlib.util.find_spec(module) is None:
        pytest.skip(f"{module} is not installed (pip install -r requirements-torch.txt)")


def run_python(args, *, devices: int = 1, timeout: int = 600, env_extra=None, cwd=REPO):
    """Runs `python args...` in a fresh process (XLA_FLAGS must be set before JAX starts)."""
    env = dict(os.environ)
    env["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={devices} {FAST_COMPILE}"
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    env.update(env_extra or {})
    return subprocess.run(
        [sys.executable, *args], cwd=cwd, env=env, timeout=timeout, capture_output=True, text=True
    )


_WITHOUT_TENSORFLOW = """
import runpy, sys

class NoTensorFlow:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("tensorflow", "tensorflow_datasets"):
            raise ImportError(f"{name} is blocked by the test")

sys.meta_path.insert(0, NoTensorFlow())
sys.argv = sys.argv[1:]
runpy.run_module(sys.argv[0], run_name="__main__")
"""


def run_module_without_tensorflow(module: str, args, **kwargs):
    """run_python of `python -m module args...` with TensorFlow and tfds made unimportable:
    tools that need no real data must not pay TF's 0.6 GB of host memory."""
    return run_python(["-c", _WITHOUT_TENSORFLOW, module, *args], **kwargs)


def on_each_train_call(monkeypatch, hook):
    """Makes the loop's train step and its several-steps call (config.steps_per_call) call
    `hook(steps)` before each call, `steps` being how many steps it runs; their `lower` (the
    loop compiles ahead of step 1) stays the jitted one's."""
    from rspc_jax.training import setup

    build = setup.build

    def hooked(step, steps_of):
        if step is None:
            return None

        def call(state, batch):
            hook(steps_of(batch))
            return step(state, batch)

        call.lower = step.lower
        return call

    def hooked_build(*args, **kwargs):
        parts = build(*args, **kwargs)
        return parts._replace(
            train_step=hooked(parts.train_step, lambda batch: 1),
            train_steps=hooked(parts.train_steps, len),
        )

    monkeypatch.setattr(setup, "build", hooked_build)

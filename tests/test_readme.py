"""README's commands as a user types them.

Every command in README's ```bash blocks, and every `python -m ...` that README's text names,
is one of these kinds (a command of no kind fails the test, naming it):

- install: the venv and `pip install -r FILE` of the quick start (.ci/run does the same
  install; the file must exist);
- suite: README's test command, which must be .ci/run's;
- run: a `python -m` command that needs only the embedded digits. It runs verbatim, in
  README's order, with `bash -c` in a scratch copy of the checkout (relative paths as written;
  TFDS_DATA_DIR a scratch folder), and must exit 0. The exported file is read back and
  matches the run's checkpoint; the reports the commands write must be there;
- parse: a `python -m` command that needs ImageNet, a bucket, a released checkpoint or an
  accelerator. Its module's flags, its config file, variant and overrides are parsed as the
  tool parses them, the config checked as `rspc_jax.main` checks it, and suite and analysis
  names looked up;
- launch: `launch/tpu_vm.sh`, run with `--dry-run` and the block's `export`ed variables;
- external: a command of another tool that needs what CI lacks (`tfds build` downloads,
  `apt`, a GPU wheel, the TensorBoard server); listed, not run.

To keep the suite short the runs add these flags to README's text (and nothing else):
SHORTER, `:smoke` for the study and plan's RVT-S (their full runs take 90 and 15+ minutes),
and `--slices=v4-8 --compiler=xla_cpu` for plan (XLA:CPU's estimate, the quicker search).
"""

import dataclasses
import os
import pathlib
import re
import shlex
import shutil
import subprocess
import sys

import pytest

from tests.conftest import REPO, assert_trees_equal

README = REPO / "README.md"
# Per module, flags appended to a run to keep the suite short.
SHORTER = {
    "rspc_jax.main": ["--config.total_steps=8"],
    # Every suite and attack of the demo's report, each on a few images with a tiny budget.
    "rspc_jax.evaluate": [
        "--config.evaluation.num_examples=32",
        "--config.evaluation.severities='(1,)'",
        "--config.evaluation.occlusion_masks=4",
        "--config.evaluation.adversarial_examples=8",
        "--config.evaluation.apgd_iters=2",
        "--config.evaluation.apgd_targets=1",
        "--config.evaluation.square_queries=20",
        "--config.evaluation.patch_fool_steps=2",
    ],
    "rspc_jax.analyze": [
        "--config.analysis.num_examples=16",
        "--config.analysis.lesion_samples=2",
        "--config.analysis.translations=3",
        "--config.analysis.rotations=3",
        "--config.analysis.spatial_examples=8",
    ],
    "benchmarks.train_step": ["--steps=2"],
}
# Prefixes of commands of other tools that need what CI lacks.
EXTERNAL = {
    "tfds build": "downloads the dataset (or reads ImageNet's tars)",
    "apt install": "installs a system package as root",
    'pip install "jax[cuda12]': "the CUDA build of JAX, for a GPU",
    "tensorboard": "starts a server",
}
INSTALL = re.compile(
    r"^(python3 -m venv \.venv|\. \.venv/bin/activate|pip install -r (?P<file>\S+))$"
)
# The configs whose data ship with the package (the embedded digits).
DIGITS_CONFIGS = ("demo", "demo_study")


@dataclasses.dataclass
class Command:
    text: str  # as README writes it, continuation lines joined
    line: int  # README's line number
    env: dict  # variables `export`ed earlier in its block


def _strip_comment(line: str) -> str:
    """A shell line without its trailing `# comment` (README's quotes hold no '#')."""
    return re.sub(r"(^|\s+)#(\s.*)?$", "", line).rstrip()


def _block_commands(lines: list[str], first: int) -> list[Command]:
    """The commands of one bash block whose first line is README line `first`: continuation
    lines joined, `for V in A B; do ... done` unrolled, `export` lines kept as environment."""
    commands, env, i = [], {}, 0
    while i < len(lines):
        start, text = i, _strip_comment(lines[i])
        while text.endswith("\\") and i + 1 < len(lines):
            i += 1
            text = text[:-1].rstrip() + " " + _strip_comment(lines[i]).strip()
        i += 1
        loop = re.match(r"^for (\w+) in (.+); do$", text)
        if loop:
            body = _strip_comment(lines[i]).strip()
            i += 2  # the body and `done`
            for value in loop.group(2).split():
                text_i = body.replace(f"${loop.group(1)}", value)
                commands.append(Command(text_i, first + start, dict(env)))
        elif text.startswith("export "):
            env.update(dict(pair.split("=", 1) for pair in shlex.split(text)[1:]))
        elif text:
            commands.append(Command(text, first + start, dict(env)))
    return commands


def readme_commands() -> list[Command]:
    """Every command of README's bash blocks and each `python -m ...` span of its text, in
    README's order (a piece of an `a && b` line is a command of its own)."""
    lines = README.read_text().splitlines()
    commands, i = [], 0
    while i < len(lines):
        if lines[i].strip() == "```bash":
            end = lines.index("```", i + 1)
            commands += _block_commands(lines[i + 1 : end], i + 2)
            i = end + 1
            continue
        if not lines[i].startswith("```"):
            for span in re.findall(r"`(python -m [^`]+)`", lines[i]):
                commands.append(Command(span, i + 1, {}))
        else:
            i = lines.index("```", i + 1)
        i += 1
    return [Command(piece.strip(), c.line, c.env) for c in commands for piece in c.text.split("&&")]


def kind(command: Command) -> str:
    text = command.text
    if INSTALL.match(text):
        return "install"
    if text.startswith("python -m pytest"):
        return "suite"
    if any(text.startswith(prefix) for prefix in EXTERNAL):
        return "external"
    if re.match(r"^(\w+=\S+ )*launch/tpu_vm\.sh ", text):
        return "launch"
    if text.startswith("python -m "):
        return "parse" if _needs_what_ci_lacks(text) else "run"
    return "unknown"


def _needs_what_ci_lacks(text: str) -> bool:
    """A bucket, a released checkpoint, a config's ImageNet/CIFAR data (its `:smoke` variant
    trains on the digits), or a workdir that only such a run makes. The planner compiles
    without data, so it runs; its pre-flight of a full-size config for a pod slice is parsed
    (tests/test_tpu_compile.py runs the pre-flight at the smoke size)."""
    if "gs://" in text or "/data/" in text:
        return True
    if text.startswith("python -m rspc_jax.plan "):
        return "--preflight" in text
    config = re.search(r"--config=configs/(\w+)\.py(:\w+)?", text)
    if config:
        return config.group(1) not in DIGITS_CONFIGS and config.group(2) != ":smoke"
    workdir = re.search(r"--workdir=(\S+)", text)
    return not (workdir and workdir.group(1).startswith("runs/demo"))


COMMANDS = readme_commands()


def test_every_readme_command_is_of_a_kind_this_test_checks():
    unknown = [f"README line {c.line}: {c.text}" for c in COMMANDS if kind(c) == "unknown"]
    assert not unknown, "add these to tests/test_readme.py's kinds:\n" + "\n".join(unknown)
    kinds = [kind(c) for c in COMMANDS]
    # README's quick start has both copy-paste commands; the demo's follow-ups run here.
    assert kinds.count("suite") == 1 and kinds.count("install") >= 4
    assert kinds.count("run") >= 8 and kinds.count("parse") >= 8 and "launch" in kinds


def test_the_install_files_exist_and_readme_tests_as_ci_does():
    ci = (REPO / ".ci" / "run").read_text().splitlines()
    for command in COMMANDS:
        match = INSTALL.match(command.text)
        if match and match.group("file"):
            assert (REPO / match.group("file")).is_file(), command
        if kind(command) == "suite":
            assert command.text in ci, f"README's test command is not .ci/run's: {command.text}"


def _scratch_checkout(path: pathlib.Path) -> pathlib.Path:
    """The files a user's clone has, without runs, venvs or caches."""
    ignore = shutil.ignore_patterns(".git", ".venv", "runs", "__pycache__", "fixtures")
    for name in ("rspc_jax", "configs", "benchmarks", "launch"):
        shutil.copytree(REPO / name, path / name, ignore=ignore)
    for name in ("README.md", "requirements.txt", "pyproject.toml"):
        shutil.copy(REPO / name, path / name)
    return path


def _shell(text: str, cwd: pathlib.Path, env: dict, timeout: int = 600):
    return subprocess.run(
        ["bash", "-c", text], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout
    )


def _failure(command: Command, result) -> str:
    tail = "\n".join((result.stdout + result.stderr).splitlines()[-25:])
    return f"README line {command.line} failed (exit {result.returncode}): {command.text}\n{tail}"


def _report(command: Command, result) -> None:
    """The command as run and its last line on stdout (else stderr; shown with `pytest -s`)."""
    lines = (result.stdout.strip() or result.stderr.strip()).splitlines() or [""]
    ran = result.args[2] if result.args[:2] == ["bash", "-c"] else command.text
    print(f"README line {command.line}: {ran}\n    -> {lines[-1][-200:]}")


def _shortened(text: str) -> str:
    """README's text with SHORTER's flags and the smoke variants of the long runs."""
    module = text.split()[2]
    if module in ("rspc_jax.study", "rspc_jax.plan"):
        text = re.sub(r"(--config=configs/\w+\.py)(\s|$)", r"\1:smoke\2", text)
    if module == "rspc_jax.plan":  # the TPU compiler's path: tests/test_tpu_compile.py
        text += " --slices=v4-8 --compiler=xla_cpu"
    return " ".join([text, *SHORTER.get(module, [])])


def _environment(tmp_path: pathlib.Path) -> dict:
    env = dict(os.environ, TFDS_DATA_DIR=str(tmp_path / "tfds"))
    env["PATH"] = os.path.dirname(sys.executable) + os.pathsep + env["PATH"]
    env.pop("PYTHONPATH", None)
    return env


def test_readme_commands_that_run_on_a_cpu_run_as_written(tmp_path):
    checkout = _scratch_checkout(tmp_path / "clone")
    env = _environment(tmp_path)
    ran = []
    for command in (c for c in COMMANDS if kind(c) == "run"):
        result = _shell(_shortened(command.text), checkout, env)
        assert result.returncode == 0, _failure(command, result)
        ran.append(command.text)
        _report(command, result)
    _check_outputs(checkout, ran)


def _check_outputs(checkout: pathlib.Path, ran: list[str]) -> None:
    """What README says the demo's follow-ups write is there; the export matches."""
    from rspc_jax.interop import checkpoints, state_dicts

    demo = checkout / "runs" / "demo"
    assert (demo / "metrics.jsonl").is_file() and (demo / "config.json").is_file()
    assert (demo / "eval" / "report.md").is_file() and (demo / "eval" / "clean.json").is_file()
    assert (demo / "analysis" / "summary.md").is_file()
    exports = [re.search(r"--out=(\S+)", t).group(1) for t in ran if "rspc_jax.export" in t]
    assert exports, "README exports no run that this machine can train"
    step, state, _ = checkpoints.read_saved_state(str(demo / "checkpoints"))
    like = dict(params=state["params"])
    for out in exports:
        assert_trees_equal(state_dicts.load_checkpoint(str(checkout / out), like), like)


_PARSE = """
import importlib, sys
from absl import flags
module = sys.argv[1]
importlib.import_module(module)
flags.FLAGS([module, *sys.argv[2:]])
config = flags.FLAGS["config"].value if "config" in flags.FLAGS else None
if config is not None:
    from rspc_jax.training import checks
    checks.validate_config(config)
if module in ("rspc_jax.evaluate", "rspc_jax.analyze"):
    from rspc_jax.evaluation import registry
    if module.endswith("evaluate"):
        registry.names("suite", flags.FLAGS.suites or config.evaluation.suites)
    else:
        registry.names("analysis", flags.FLAGS.analysis)
print("parsed", module, config.model_name if config is not None else "")
"""


@pytest.mark.parametrize(
    "command",
    [c for c in COMMANDS if kind(c) == "parse"],
    ids=lambda c: f"line{c.line}",
)
def test_readme_commands_that_need_imagenet_or_an_accelerator_parse(command, tmp_path):
    words = shlex.split(command.text)
    assert words[:2] == ["python", "-m"], command
    result = subprocess.run(
        [sys.executable, "-c", _PARSE, *words[2:]],
        cwd=REPO,
        env=_environment(tmp_path),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, _failure(command, result)
    assert f"parsed {words[2]}" in result.stdout
    _report(command, result)


def test_readme_launch_commands_print_their_gcloud_commands(tmp_path):
    commands = [c for c in COMMANDS if kind(c) == "launch"]
    for command in commands:
        text = command.text.replace("launch/tpu_vm.sh ", "launch/tpu_vm.sh --dry-run ", 1)
        env = {**_environment(tmp_path), **command.env}
        result = _shell(text, REPO, env, timeout=60)
        assert result.returncode == 0 and "gcloud " in result.stdout, _failure(command, result)
        _report(command, result)


def test_readme_python_snippets_compile():
    text = README.read_text()
    snippets = re.findall(r"```python\n(.*?)```", text, flags=re.S)
    assert snippets
    for snippet in snippets:
        compile(snippet, "README.md", "exec")

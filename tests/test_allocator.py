"""The command-line tools restart once with tcmalloc preloaded where the system has it
(rspc_jax.tools.allocator), keep their arguments, never loop, and `--malloc=system` opts out."""

import json

from rspc_jax.tools import allocator
from tests.conftest import run_python, system_tcmalloc

# A tool built like the package's: cli.run parses the flags, main calls cli.start. It reports
# what the process it ended up in has. `LIBRARY` stands in for the system's tcmalloc.
_TOOL = """
import json, os, sys
from rspc_jax.tools import allocator, cli
LIBRARY = {library!r}
if LIBRARY:
    allocator.find_tcmalloc = lambda: LIBRARY

def main(argv):
    cli.start(argv)
    print(json.dumps(dict(
        argv=argv[1:], orig_argv=sys.orig_argv[1:], preload=os.environ.get("LD_PRELOAD", ""),
        tcmalloc=allocator.loaded_tcmalloc(), described=allocator.describe())))

cli.run(main)
"""


def _run_tool(tmp_path, library, *flags, env_extra=None):
    script = tmp_path / "tool.py"
    script.write_text(_TOOL.format(library=library))
    done = run_python([str(script), *flags], env_extra={"LD_PRELOAD": "", **(env_extra or {})})
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_preload_environment_puts_the_library_first_and_keeps_the_users_settings():
    env = allocator.preload_environment({"LD_PRELOAD": "libmine.so", "PATH": "/bin"}, "libtc.so.4")
    assert env["LD_PRELOAD"] == "libtc.so.4 libmine.so"
    assert env["PATH"] == "/bin"
    assert int(env["TCMALLOC_LARGE_ALLOC_REPORT_THRESHOLD"]) >= 1 << 40  # no report per step
    mine = {"TCMALLOC_LARGE_ALLOC_REPORT_THRESHOLD": "123"}
    assert (
        allocator.preload_environment(mine, "libtc.so.4")["TCMALLOC_LARGE_ALLOC_REPORT_THRESHOLD"]
        == "123"
    )
    assert allocator.preload_environment({}, "libtc.so.4")["LD_PRELOAD"] == "libtc.so.4"


def test_the_tool_restarts_once_with_the_library_preloaded_and_the_same_arguments(tmp_path):
    # libm stands in for tcmalloc: preloading it changes nothing, so the restarted process
    # finds no tcmalloc mapped, and must not restart again.
    result = _run_tool(tmp_path, "libm.so.6", "--verbose")
    assert result["preload"] == "libm.so.6"
    assert result["orig_argv"][-1] == "--verbose" and result["argv"] == []
    assert result["tcmalloc"] is None
    assert "libm.so.6 could not be preloaded" in result["described"]


def test_malloc_system_keeps_the_c_librarys_allocator(tmp_path):
    result = _run_tool(tmp_path, "libm.so.6", "--malloc=system")
    assert result["preload"] == ""
    assert result["tcmalloc"] is None


def test_an_allocator_the_user_preloaded_is_kept(tmp_path):
    # The name is what counts: libm stands in for the user's jemalloc again.
    result = _run_tool(tmp_path, "libm.so.6", env_extra={"LD_PRELOAD": "/opt/libjemalloc.so.2"})
    assert result["preload"] == "/opt/libjemalloc.so.2"
    assert result["described"] == "the preloaded /opt/libjemalloc.so.2"


def test_a_process_that_has_tcmalloc_already_is_not_restarted(tmp_path):
    library = system_tcmalloc()
    result = _run_tool(tmp_path, None, env_extra={"LD_PRELOAD": library})
    assert "libtcmalloc" in result["tcmalloc"]
    assert result["preload"] == library  # not prepended a second time
    assert result["described"].startswith("tcmalloc")


def test_the_system_tcmalloc_is_preloaded_where_installed(tmp_path):
    system_tcmalloc()
    result = _run_tool(tmp_path, None)
    assert "libtcmalloc" in result["tcmalloc"]
    assert result["described"].startswith("tcmalloc")

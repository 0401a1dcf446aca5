"""Issue 19's bounds on the commands a newcomer runs first: `python -c "import fw"` (0.3 s) and `fw --help`
(0.5 s) import none of the heavy libraries, and stay well under their bounds in a fresh process. The time
checked is the process's CPU time (user + system), which a busy shared machine stretches far less than
wall time, with 3x the bound as margin; importing torch alone takes more than that, so either check
fails when a heavy import creeps in."""

from __future__ import annotations

import os
import statistics
import subprocess
import sys

import pytest

HEAVY = ("torch", "transformers", "fastapi", "uvicorn", "numpy", "jinja2", "tokenizers", "safetensors", "gguf",
         "xgrammar", "outlines_core", "jsonschema", "pydantic")
REPORT = ("import sys; heavy = {heavy!r}; "
          "print(sorted(m for m in sys.modules if m.split('.')[0] in heavy))")


def run(code: str) -> tuple[float, str]:
    """(CPU seconds, stdout) of a fresh interpreter running `code`."""
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={k: v for k, v in os.environ.items() if not k.startswith("FW_")})
    out, err = proc.stdout.read(), proc.stderr.read()
    _, status, usage = os.wait4(proc.pid, 0)
    proc.returncode = os.waitstatus_to_exitcode(status)
    assert proc.returncode == 0, err
    return usage.ru_utime + usage.ru_stime, out


IMPORT_FW = "import fw; " + REPORT.format(heavy=HEAVY)
HELP = ("import contextlib, io, sys\nfrom fw.cli.main import main\nwith contextlib.redirect_stdout(io.StringIO()) as out:\n"
        "    try:\n        main(['--help'])\n    except SystemExit:\n        pass\nassert 'serve' in out.getvalue()\n"
        + REPORT.format(heavy=HEAVY))


@pytest.mark.parametrize("code, bound", [(IMPORT_FW, 0.3), (HELP, 0.5)], ids=["import fw", "fw --help"])
def test_first_commands_stay_light(code: str, bound: float) -> None:
    runs = [run(code) for _ in range(3)]
    assert runs[0][1].strip() == "[]", f"heavy modules imported: {runs[0][1]}"
    median = statistics.median(t for t, _ in runs)
    assert median <= 3 * bound, f"median {median:.2f} CPU s over 3 fresh processes; the bound is {bound} s"

"""The Python sandbox (real subprocesses) and the code verifier that runs tests in it."""

import os
import signal
import socket
import subprocess
import sys
import time

import pytest

from tandem import sandbox
from tandem.errors import TandemError
from tandem.reward import VERIFIERS, RewardPool, load_reward_fn
from tandem.reward.code import CodeLimits, extract_program, parse_tests, run_tests
from tandem.sample import Prompt, Sample
from tandem.sandbox import run_python

pytestmark = pytest.mark.skipif(sys.platform == "win32", reason="the sandbox needs POSIX")

# --- the sandbox -----------------------------------------------------------------------------


def test_output_stdin_and_return_code():
    result = run_python("import sys\nprint('out', input())\nprint('err', file=sys.stderr)\nsys.exit(3)", "in")
    assert (result.stdout, result.stderr, result.returncode) == ("out in\n", "err\n", 3)
    assert not result.timed_out and not result.ok
    assert run_python("print(1 + 1)").ok


def test_an_endless_loop_is_killed_at_its_timeout():
    start = time.monotonic()
    result = run_python("print('started', flush=True)\nwhile True:\n    pass", timeout_s=0.5)
    assert 0.5 <= time.monotonic() - start < 1.5
    assert result.timed_out and result.returncode is None and not result.ok
    assert result.stdout == "started\n"  # what came before the kill is kept


@pytest.mark.parametrize("holds_pipes", [True, False])
def test_stray_processes_are_killed(holds_pipes):
    # A grandchild that keeps the pipes open holds the call until the timeout; one that closes them
    # lets the call end when the program does. Either way it must not outlive the call.
    closes = "" if holds_pipes else "os.close(1)\n    os.close(2)\n    "
    code = f"import os, time\npid = os.fork()\nif pid == 0:\n    {closes}time.sleep(30)\nprint(pid)"
    result = run_python(code, timeout_s=0.5)
    assert result.timed_out == holds_pipes and result.ok != holds_pipes
    assert _dies(int(result.stdout))


def test_memory_beyond_the_limit_fails():
    result = run_python("big = bytearray(2 * 1024**3)\nprint('allocated')", memory_mb=256)
    assert not result.ok and "MemoryError" in result.stderr and "allocated" not in result.stdout
    assert run_python("big = bytearray(100 * 1024**2)\nprint('allocated')", memory_mb=256).ok


NETWORK = """
import socket, sys
def attempt(what, fn):
    try:
        fn()
        print(what, "reached")
    except OSError as e:
        print(what, "refused", type(e).__name__)
port = int(sys.stdin.read())
attempt("ip", lambda: socket.create_connection(("127.0.0.1", port), timeout=1))
attempt("name", lambda: socket.create_connection(("localhost", port), timeout=1))
"""


@pytest.fixture
def listener():
    """A port on this machine that accepts connections: reachable unless the sandbox stops it."""
    with socket.create_server(("127.0.0.1", 0)) as server:
        yield str(server.getsockname()[1])


def test_network_is_refused(listener):
    with socket.create_connection(("localhost", int(listener)), timeout=1):
        pass  # reachable from here
    out = run_python(NETWORK, stdin=listener).stdout.splitlines()
    assert [line.rsplit(" ", 1)[0] for line in out] == ["ip refused", "name refused"]
    assert sandbox.network_isolation() in ("namespace", "audit-hook")


def test_network_is_refused_by_the_audit_hook_without_a_namespace(monkeypatch, listener):
    monkeypatch.setattr(sandbox, "_NETNS_FLAGS", ())  # read in the forked child: no unshare
    result = run_python(NETWORK + "import os\nos.system('true')", stdin=listener)
    assert result.stdout.splitlines() == ["ip refused PermissionError", "name refused PermissionError"]
    assert "os.system is refused" in result.stderr
    pair = run_python("import socket\na, b = socket.socketpair()\na.send(b'x')\nprint(b.recv(1))")
    assert pair.stdout == "b'x'\n"  # Unix sockets are not network


def test_the_temporary_directory_is_removed():
    result = run_python("import os\nopen('left.txt', 'w').write('x')\nprint(os.getcwd())")
    workdir = result.stdout.strip()
    assert result.ok and os.path.basename(workdir).startswith("tandem-sandbox-")
    assert workdir != os.getcwd() and not os.path.exists(workdir)


def test_output_is_cut_to_max_output_bytes():
    code = "import sys\nprint('x' * 1_000_000)\nprint('y' * 1_000_000, file=sys.stderr)"
    result = run_python(code, max_output_bytes=100)
    assert result.ok and result.stdout == "x" * 100 and result.stderr == "y" * 100


def test_a_minimal_environment_in_isolated_mode(monkeypatch):
    monkeypatch.setenv("SECRET", "s3cret")
    monkeypatch.setenv("PYTHONPATH", "/nowhere")
    code = "import os, sys\nprint(os.environ.get('SECRET'), os.environ.get('PYTHONPATH'), sys.flags.isolated)"
    assert run_python(code).stdout == "None None 1\n"


def test_the_child_dies_with_its_parent():
    code = "from tandem.sandbox import run_python\nrun_python('import time\\ntime.sleep(30)', timeout_s=30)"
    parent = subprocess.Popen([sys.executable, "-c", code])
    try:
        child = _wait_for_child(parent.pid)
    finally:
        parent.send_signal(signal.SIGKILL)
        parent.wait()
    assert _dies(child)


def _wait_for_child(pid: int) -> int:
    deadline = time.monotonic() + 5.0
    while time.monotonic() < deadline:
        found = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True).stdout.split()
        if found:
            return int(found[0])
        time.sleep(0.02)
    raise AssertionError("the sandbox child never started")


def _dies(pid: int) -> bool:
    """Whether `pid` is gone or a zombie (until init reaps it) within a second; SIGKILL is not instant."""
    deadline = time.monotonic() + 1.0
    while time.monotonic() < deadline:
        try:
            with open(f"/proc/{pid}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] == "Z":
                    return True
        except FileNotFoundError:
            return True
        time.sleep(0.02)
    return False


def test_no_sandbox_without_resource_limits(monkeypatch):
    monkeypatch.setattr(sandbox, "resource", None)
    with pytest.raises(TandemError, match="needs a POSIX system"):
        run_python("print('unlimited')")


# --- the code verifier -----------------------------------------------------------------------

ADD = "def add(a, b):\n    return a + b\n"
ASSERTS = ["assert add(1, 2) == 3", "assert add(2, 2) == 4", "assert add(2, 2) == 5"]
ECHO_SUM = "print(sum(int(x) for x in input().split()))\n"
IO_TESTS = {"inputs": ["1 2\n", "3 4\n", "5 5\n"], "outputs": ["3\n", "7", "11\n"]}


def code_score(response: str, ground_truth: object, **limits) -> tuple[float, dict[str, float]]:
    return VERIFIERS.get("code")(response, ground_truth, {}, code_limits=CodeLimits(**limits))


def test_score_is_the_fraction_of_asserts_passed():
    score, parts = code_score(ADD, ASSERTS)
    assert score == pytest.approx(2 / 3, abs=1e-4) and parts == {"code/passed": score, "code/timeouts": 0.0}
    assert code_score(ADD, ASSERTS[:2])[0] == 1.0


def test_stdin_stdout_tests_compare_stripped_lines():
    assert code_score(ECHO_SUM, IO_TESTS)[0] == pytest.approx(2 / 3, abs=1e-4)
    two_lines = {"inputs": ["2\n"], "outputs": ["a  \n b\n\n"]}
    assert code_score("input()\nprint('a')\nprint('b')", two_lines)[0] == 1.0
    assert code_score("input()\nprint('a b')", two_lines)[0] == 0.0
    assert code_score(ECHO_SUM + "raise SystemExit(1)", IO_TESTS)[0] == 0.0  # right output, bad exit


def test_ground_truth_as_a_json_string():
    import json

    assert code_score(ADD, json.dumps(ASSERTS))[0] == pytest.approx(2 / 3, abs=1e-4)
    assert code_score(ECHO_SUM, json.dumps(IO_TESTS))[0] == pytest.approx(2 / 3, abs=1e-4)


def test_the_program_is_the_last_fenced_block():
    response = (
        f"First try:\n```python\ndef add(a, b):\n    return a - b\n```\nBetter:\n```python\n{ADD}```\n"
        "Usage:\n```text\nadd(1, 2)\n```"
    )
    assert extract_program(response) == ADD
    assert extract_program(f"```\n{ADD}```") == ADD
    assert extract_program(ADD) == ADD
    assert code_score(response, ASSERTS[:2])[0] == 1.0


def test_crashing_or_looping_tests_score_zero_without_failing_the_others():
    tests = ["assert add(1, 2) == 3", "1 / 0", "while True: pass", "assert add(0, 1) == 1"]
    start = time.monotonic()
    score, parts = code_score(ADD, tests, timeout_s=0.5)
    assert time.monotonic() - start < 2.0
    assert (score, parts["code/timeouts"]) == (0.5, 1.0)


def test_the_budget_bounds_all_tests_together():
    start = time.monotonic()
    score, parts = run_tests("while True: pass", parse_tests(ASSERTS, "code"), CodeLimits(5.0, 512, 0.6))
    assert time.monotonic() - start < 1.5
    assert (score, parts["code/timeouts"]) == (0.0, 3.0)


@pytest.mark.parametrize(
    "ground_truth, why",
    [
        (None, "is a NoneType"),
        ([], "empty"),
        ("assert add(1, 2) == 3", "not JSON"),
        ({"inputs": ["1"]}, "keys"),
        ({"fn_name": "add", "inputs": [[1, 2]], "outputs": [3]}, "call-based"),
    ],
)
def test_a_row_without_usable_tests_is_a_clear_error(ground_truth, why):
    prompt = Prompt(text="write add", ground_truth=ground_truth, data_source="mbpp")
    with pytest.raises(TandemError, match=f"data source 'mbpp'.*{why}.*list of assert statements"):
        load_reward_fn("code")(prompt, ADD)


def test_code_through_the_pool_within_its_timeout():
    rows = [(ADD, ASSERTS), ("def add(a, b):\n    while True: pass", ASSERTS), (ADD, None)]
    samples = [
        Sample(Prompt(text="q", ground_truth=gt, data_source="code"), [1], response_text=r) for r, gt in rows
    ]
    # Per-test 5 s, but the pool's 2 s per sample leave the tests a 1 s budget: the looping
    # response is scored (0, 3 tests out of time) rather than killed as a pool timeout.
    with RewardPool("code", num_workers=2, timeout_s=2.0, sandbox_timeout_s=5.0) as pool:
        metrics = pool.score(samples)
    assert metrics == {"reward/errors": 1.0, "reward/timeouts": 0.0, "reward/output_bytes": 0.0}  # no tests
    assert samples[0].reward == pytest.approx(2 / 3, abs=1e-4)
    assert samples[0].reward_parts == {"code/passed": samples[0].reward, "code/timeouts": 0.0}
    assert (samples[1].reward, samples[1].reward_parts) == (0.0, {"code/passed": 0.0, "code/timeouts": 3.0})
    assert samples[2].reward == 0.0


def test_auto_dispatches_data_source_code():
    prompt = Prompt(text="q", ground_truth=ASSERTS, data_source="code")
    score, parts = load_reward_fn("auto")(prompt, ADD)
    assert score == pytest.approx(2 / 3, abs=1e-4) and parts["code/passed"] == score

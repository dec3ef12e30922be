"""The thread pool's claims (csrc/threads/thread_pool.cc): tasks are taken one at a time by
whichever thread is running, so a worker that is held up (another process preempting it)
holds up only the task it claimed, and results never depend on who ran what.

* The pool alone: csrc/tests/pool_main.cc, compiled with csrc/threads/ and run per case
  (hypothesis over task counts incl. 0, 1 and fewer tasks than threads, thread counts,
  task lengths, and a task that throws): every task runs exactly once, a throw reaches the
  caller without a deadlock or std::terminate, and the pool keeps working, resizes and
  shuts down.
* A held-up worker (QDSL_POOL_TEST_DELAY_US: the first worker sleeps after each claim, as a
  preempted thread does): the caller takes the other tasks, and whole graphs still equal the
  Python reference bit for bit at 1-4 threads (a subprocess: the variable is read once).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

ROOT = Path(__file__).resolve().parents[2]
CSRC = ROOT / "csrc"
CXX = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++") or shutil.which("clang++")
_LINE = re.compile(r"ok tasks=(\d+) caller=(\d+) parallel=(\d+) serial=(\d+) thrown=(\d) pulls=(\d+) pushes=(\d+)")


@pytest.fixture(scope="module")
def pool_main(tmp_path_factory):
    if CXX is None:
        pytest.skip("no C++ compiler")
    exe = tmp_path_factory.mktemp("pool") / "pool_main"
    build = subprocess.run([CXX, "-std=c++17", "-O1", "-pthread", f"-I{CSRC}", f"-I{CSRC / 'include'}",
                            str(CSRC / "tests" / "pool_main.cc"), str(CSRC / "threads" / "thread_pool.cc"),
                            str(CSRC / "threads" / "placement.cc"),
                            "-o", str(exe)], capture_output=True, text=True)
    assert build.returncode == 0, build.stderr
    return exe


def _run(exe, jobs, tasks, threads, spin_us, throw_at, **env) -> dict:
    # QDSL_POOL_ADAPT=0: every job goes to the pool (SoloPolicy could run some in the caller)
    run = subprocess.run([str(exe), str(jobs), str(tasks), str(threads), str(spin_us), str(throw_at)],
                         capture_output=True, text=True, timeout=120,
                         env={**os.environ, "QDSL_POOL_ADAPT": "0", **env})
    m = _LINE.search(run.stdout)
    assert run.returncode == 0 and m, run.stdout + run.stderr
    return dict(zip(("tasks", "caller", "parallel", "serial", "thrown", "pulls", "pushes"), map(int, m.groups())))


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(jobs=st.integers(1, 3), tasks=st.integers(0, 40), threads=st.integers(1, 5),
       spin_us=st.sampled_from([0, 20]), throw=st.integers(-1, 40))
def test_every_task_runs_once_at_any_count(pool_main, jobs, tasks, threads, spin_us, throw):
    got = _run(pool_main, jobs, tasks, threads, spin_us, throw)
    pooled = threads > 1 and tasks > 1
    assert got["parallel"] == (jobs if pooled else 0)
    assert got["serial"] == (0 if pooled else jobs)
    assert got["tasks"] == (jobs * tasks if pooled else 0)
    assert got["thrown"] == (1 if 0 <= throw < tasks else 0)


@pytest.mark.parametrize("threads", [2, 3])
def test_a_throwing_task_reaches_the_caller_and_the_pool_goes_on(pool_main, threads):
    # the first task throws while the others spin: the caller rethrows after the claimed
    # ones end, the next two jobs run every task once on the pool
    got = _run(pool_main, 3, 24, threads, 200, 0)
    assert (got["tasks"], got["parallel"], got["serial"], got["thrown"]) == (72, 3, 0, 1)


@pytest.mark.parametrize("place", ["1", "0"])
def test_the_caller_takes_a_held_up_workers_tasks(pool_main, place):
    # the worker sleeps 300 ms after each claim; 16 tasks of 300 us take the caller ~5 ms,
    # so the worker holds at most its one claim per job and the caller runs the rest.
    # Placement: waiting for the held task, the caller sees the worker's CPU clock stand
    # still and moves it onto its own core (pool_main checks that no thread's CPU mask is
    # left changed); with QDSL_POOL_PLACE=0 nothing moves.
    got = _run(pool_main, 2, 16, 2, 300, -1, QDSL_POOL_TEST_DELAY_US="300000", QDSL_POOL_PLACE=place)
    assert got["parallel"] == 2 and got["tasks"] == 32
    assert got["caller"] >= 32 - 2
    if place == "0":
        assert got["pulls"] == 0 and got["pushes"] == 0
    elif sys.platform.startswith("linux") and len(os.sched_getaffinity(0)) > 1:
        assert got["pulls"] >= 1


_GRAPH_SCRIPT = r"""
import sys
import numpy as np
import qdsl.runtime as rt
from qdsl.graph.qgraph import load_graph
d = sys.argv[1]
for name in sys.argv[2:]:
    cg = rt.CompiledGraph(load_graph(f"{d}/{name}.qgraph"))
    x = np.load(f"{d}/{name}.x.npy")
    for t in (1, 2, 3, 4):
        rt.set_num_threads(t)
        np.save(f"{d}/{name}.{t}.npy", cg.run(x))
"""


@pytest.mark.parametrize("adapt", ["0", "1"])
def test_graphs_with_a_held_up_worker_equal_the_reference(tmp_path, adapt):
    import qdsl.runtime as rt

    if not rt.available():
        pytest.skip(f"C++ runtime not built: {rt.load_error()}")
    from qdsl.graph import execute
    from qdsl.graph.qgraph import save_graph

    from tests.runtime.test_graph import _rand
    from tests.runtime.test_threads import _chain

    rng = np.random.default_rng(18)
    from qdsl.graph.ir import DType

    cases = {"chain": (_chain(6, 64, 33), _rand(rng, DType.U8, (1, 64, 33, 33))),
             "chain2": (_chain(3, 64, 47), _rand(rng, DType.U8, (2, 64, 47, 47)))}
    for name, (graph, x) in cases.items():
        save_graph(graph, tmp_path / f"{name}.qgraph")
        np.save(tmp_path / f"{name}.x.npy", x)
    run = subprocess.run([sys.executable, "-c", _GRAPH_SCRIPT, str(tmp_path), *cases], cwd=ROOT,
                         capture_output=True, text=True, timeout=300,
                         env={**os.environ, "QDSL_POOL_TEST_DELAY_US": "2000", "QDSL_POOL_ADAPT": adapt})
    assert run.returncode == 0, run.stderr
    for name, (graph, x) in cases.items():
        want = execute(graph, [x]).outputs[0]
        for t in (1, 2, 3, 4):
            np.testing.assert_array_equal(np.load(tmp_path / f"{name}.{t}.npy"), want, err_msg=f"{name} at {t} threads")

"""trainer/pipe.py's timed queue waits in a process of their own: SIGTERM taken by another thread still reaches a main
thread waiting on an empty or a full queue."""
import os
import subprocess
import sys
import textwrap

import pytest

from runs import REPO


@pytest.mark.parametrize("wait", ["pipe.wake_get(queue.Queue())",
                                  "q = queue.Queue(maxsize=1); q.put(0); pipe.wake_put(q, 1)"])
def test_a_signal_taken_by_another_thread_still_reaches_a_waiting_main_thread(wait):
    """The kernel may hand SIGTERM to any thread; Python runs its handler on the main thread. A main thread that
    waits on an empty queue (a hung target forward feeds nothing) or a full one (a send that never drains) must
    still run it: pipe.wake_get's / wake_put's timed waits. An untimed q.get() in its place keeps this process
    waiting past the 90 s timeout (tried on CPython 3.11; 90 s, not 20: importing torch on a loaded 2-core
    machine took over 20 s)."""
    code = textwrap.dedent("""
        import os, queue, signal, threading, time
        from trainer import pipe
        signal.signal(signal.SIGTERM, lambda *a: os._exit(7))
        sleeper = threading.Thread(target=lambda: time.sleep(3600), daemon=True)
        sleeper.start()
        time.sleep(0.2)
        signal.pthread_kill(sleeper.ident, signal.SIGTERM)
    """) + wait
    r = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=dict(os.environ, PYTHONPATH=str(REPO)),
                       capture_output=True, text=True, timeout=90)
    assert r.returncode == 7, r.stderr[-2000:]

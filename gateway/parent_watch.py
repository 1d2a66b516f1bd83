"""A process that must not outlive the one that started it exits once that one is gone.

An engine the gateway started: the gateway starts its engines in a session of their own (so a
terminal's Ctrl+C reaches only the gateway, which stops them in order, and its SIGTERM to the process
group reaches a `command:`'s own children too), so nothing ended them when the gateway itself was
SIGKILLed or crashed: the engine served on unsupervised, with the old config, and the restarted
gateway's new engine could not bind its port. The gateway names itself in `WEIR_ENGINE_PARENT_PID`.

A granian worker of `weir serve --server granian`: granian's main process SIGKILLed left its worker
serving the port, unsupervised (gateway.cli). The `weir serve` that `weir demo` starts: a SIGKILLed
demo left its gateway (and the gateway's engine) serving on.

A thread polls whether the parent is still there (portable, unlike Linux's PR_SET_PDEATHSIG, and no
`preexec_fn` in a threaded gateway)."""

from __future__ import annotations

import logging
import os
import signal
import threading
import time

# Set by gateway/engine_supervisor.py for the engines it starts.
PARENT_PID_ENV = "WEIR_ENGINE_PARENT_PID"
# Set by `weir demo` for the `weir serve` it starts (gateway.cli), which ends with it.
GATEWAY_PARENT_PID_ENV = "WEIR_GATEWAY_PARENT_PID"
CHECK_INTERVAL_S = 0.5
# After the SIGTERM, how long an engine's clean shutdown may take (a model still loading holds the
# process until its thread returns) before the process ends without one.
GRACE_S = 10.0

log = logging.getLogger(__name__)


def _gone(parent: int, first_ppid: int) -> bool:
    """Whether the gateway is gone: this process was reparented (the gateway was its parent, or the
    wrapper a `command:` runs it under died), or the gateway's pid no longer exists (a wrapper that
    lives on, such as a shell that did not `exec`)."""
    if os.getppid() != first_ppid:
        return True
    try:
        os.kill(parent, 0)
    except ProcessLookupError:
        return True
    except PermissionError:  # it exists, as another user's process
        pass
    return False


def exit_with_parent(parent: int, grace_s: float = GRACE_S, who: str = "the gateway") -> threading.Thread:
    """Starts a daemon thread that shuts this process down (SIGTERM to itself: the server's own clean
    shutdown, then `os._exit` after `grace_s`) once `parent` (`who`, in the log line) is gone."""
    first_ppid = os.getppid()

    def watch() -> None:
        while not _gone(parent, first_ppid):
            time.sleep(CHECK_INTERVAL_S)
        log.warning("%s (pid %d) that started this process is gone: shutting down", who, parent)
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(grace_s)
        os._exit(1)

    thread = threading.Thread(target=watch, name="parent-watch", daemon=True)
    thread.start()
    return thread


def watch_parent_from_env() -> None:
    """`exit_with_parent` for the pid in WEIR_ENGINE_PARENT_PID, when the gateway set one."""
    value = os.environ.get(PARENT_PID_ENV, "")
    if value.isdigit():
        exit_with_parent(int(value))

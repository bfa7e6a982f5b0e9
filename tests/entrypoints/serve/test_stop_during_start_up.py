"""A stop signal during `jpaged serve`'s start-up ends the process with status 0 within seconds, in
every phase: while the weights load, while process 0 waits for the other processes to join, and
during the grid warm-up (which stops after the program compiling now, not after the grid)."""

from __future__ import annotations

import os
import signal
import subprocess
import time

import httpx
import pytest

from tests.helpers.server import Server, free_port, start_server

# A start-up phase has this long to end after SIGTERM (one program's compile at most, here well
# under a second; the grid of SERVE_ARGS with --warmup grid takes minutes on this CPU).
EXIT_WITHIN_S = 30.0


def _wait_for_log(server: Server, words: str, timeout: float = 240.0) -> None:
    deadline = time.monotonic() + timeout
    while words not in server.log():
        assert server.process.poll() is None, f"the server exited with {server.process.returncode}:\n{server.log()}"
        assert time.monotonic() < deadline, f"no {words!r} in {timeout} s:\n{server.log()}"
        time.sleep(0.05)


def _terminated_status(server: Server) -> int | None:
    """SIGTERM, then the exit status if the process ends within EXIT_WITHIN_S (else None; it is killed)."""
    server.process.send_signal(signal.SIGTERM)
    try:
        return server.process.wait(EXIT_WITHIN_S)
    except subprocess.TimeoutExpired:
        server.process.kill()
        server.process.wait()
        return None


def _fresh_cache_env(tmp_path) -> dict[str, str]:
    """An empty compilation cache of the server's own (in place of the test session's), so the grid compiles."""
    return {"JPAGED_CACHE_DIR": str(tmp_path / "cache"), "JAX_COMPILATION_CACHE_DIR": str(tmp_path / "cache" / "jax")}


def test_sigterm_during_the_grid_warm_up_exits_0_without_compiling_the_rest(tmp_path):
    server = start_server(tmp_path, "--warmup", "grid", env=_fresh_cache_env(tmp_path))
    deadline = time.monotonic() + 240
    while True:  # until /health says the server is warming up
        assert server.process.poll() is None, server.log()
        assert time.monotonic() < deadline, server.log()
        try:
            health = httpx.get(server.base_url + "/health", timeout=5)
            if health.status_code == 503 and health.text == "starting":
                break
        except httpx.HTTPError:
            pass
        time.sleep(0.05)
    time.sleep(2.0)  # the compile thread is well into the grid
    status = _terminated_status(server)
    assert status == 0, server.log()
    assert "warm-up stopped after" in server.log() and "warm-up done" not in server.log()


def test_sigterm_while_process_0_waits_for_the_others_exits_0(tmp_path):
    server = start_server(tmp_path, "--num-processes", "2", "--process-id", "0",
                          "--coordinator-address", f"127.0.0.1:{free_port()}", "--join-timeout", "300",
                          env={"JPAGED_PLAN_SECRET": "a test secret of 32 bytes or so!"})
    _wait_for_log(server, "waiting for 1 followers")
    assert _terminated_status(server) == 0, server.log()


def test_sigterm_while_the_weights_load_exits_0(tmp_path):
    server = start_server(tmp_path)
    # engine_args logs this line while it builds the config, before the weights are read
    _wait_for_log(server, "lowered to the model's max_position_embeddings")
    assert _terminated_status(server) == 0, server.log()
    assert "serving stdlib-lm" not in server.log()  # it stopped before serving


@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")  # (the swallowed exception)
def test_a_stop_swallowed_by_a_gc_callback_is_still_seen_before_serving(monkeypatch):
    """A signal that lands while a garbage-collection callback runs (jax registers one) raises inside
    it, and Python ignores that exception: the stop must still end the start-up (seen once in a
    fresh-clone run: the server served on after SIGTERM)."""
    import gc

    from jpaged.entrypoints.serve import launch

    monkeypatch.setattr(launch, "_stop_signal", [])
    callback = lambda phase, info: launch._stopped(signal.SIGTERM, None) if phase == "start" else None  # noqa: E731
    gc.callbacks.append(callback)
    try:
        gc.collect()  # the handler's exception is printed and ignored here
    finally:
        gc.callbacks.remove(callback)
    with pytest.raises(launch._Stopped, match="SIGTERM"):
        launch._raise_if_stopped()

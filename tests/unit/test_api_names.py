"""The names ``import p2psync`` offers: ``dir()``/``__all__`` without importing torch, and
``p2psync.session()`` before and after attach (the submodule ``p2psync.api.session`` must not
shadow the function)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from p2psync.topology import ring, save

pytestmark = pytest.mark.timeout(60)

ROOT = Path(__file__).resolve().parents[2]
API = {"Session", "attach", "log", "no_sync", "session", "shard", "should_stop"}


def test_dir_lists_the_api_without_importing_torch() -> None:
    code = ("import json, sys, p2psync, p2psync.api; print(json.dumps({'dir': dir(p2psync), 'all': p2psync.__all__, "
            "'api_dir': dir(p2psync.api), 'api_all': p2psync.api.__all__, 'torch': 'torch' in sys.modules}))")
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=50)
    assert r.returncode == 0, r.stderr
    got = json.loads(r.stdout)
    assert not got["torch"]
    assert set(got["all"]) == API and API <= set(got["dir"]) and "__version__" in got["dir"]
    assert {"Session", "attach", "log_values", "shard", "should_stop"} <= set(got["api_all"]) <= set(got["api_dir"])


def test_session_is_the_function_once_the_session_module_is_imported(monkeypatch: pytest.MonkeyPatch) -> None:
    import p2psync
    import p2psync.api.session  # noqa: F401  (what attach imports: it used to shadow the function)
    from p2psync.api import facade

    monkeypatch.delenv("P2PSYNC_NODE", raising=False)
    monkeypatch.setattr(facade, "_current", None)
    assert p2psync.session is facade.session and p2psync.log is facade.log_values
    assert {name: getattr(p2psync, name) for name in API - {"log"}} == {name: getattr(facade, name) for name in API - {"log"}}
    assert p2psync.session() is None  # a single node: no session, before attach and after
    import torch

    model = torch.nn.Linear(2, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    assert p2psync.attach(model, opt) is opt and p2psync.session() is None


def test_session_exists_before_attach_under_p2psync_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Under ``p2psync run`` (P2PSYNC_NODE set) the process's one Session exists before attach,
    unattached, so that state can be registered on it first."""
    import p2psync
    from p2psync.api import facade
    from p2psync.api.session import Session

    topo = tmp_path / "r2.json"
    save(ring(2), topo)
    monkeypatch.setenv("P2PSYNC_NODE", "1")
    monkeypatch.setenv("P2PSYNC_TOPOLOGY", str(topo))
    monkeypatch.delenv("P2PSYNC_CONFIG", raising=False)
    monkeypatch.setattr(facade, "_current", None)
    monkeypatch.setattr(facade, "_hooks_installed", True)  # no atexit handler in the test process
    s = p2psync.session()
    try:
        assert isinstance(s, Session) and s.node_id == 1 and s.replica is None
        assert p2psync.session() is s and not p2psync.should_stop()
        s.register_state("counter", lambda: 3, lambda v: None)
        assert s.state_dict()["extra"] == {"counter": 3}
    finally:
        assert s is not None
        s.close()

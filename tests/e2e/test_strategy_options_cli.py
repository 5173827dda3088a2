"""Every strategy's options are checked at the CLI edge: a bad option or value ends
``p2psync run`` with exit 2 and one line naming the option, before any node process starts
(issue 18: a bad ESync mode used to be caught in ``start()``, after the rendezvous)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from p2psync.strategies import REGISTRY

ROOT = Path(__file__).resolve().parents[2]

#: strategy -> (a bad --opt, what the error must name)
BAD = {
    "ssgd": ("rounds=3", "rounds"),  # no options at all: any name is unknown
    "asp": ("s=3", "--opt s"),
    "bsp": ("s=3", "--opt s"),
    "asgd": ("send_timeout=0", "send_timeout=0"),
    "esync": ("mode=fast", "mode='fast'"),
    "dts": ("t=-1", "t=-1"),
    "diloco": ("eager_delay=2", "eager_delay=2"),
    "diloco-async": ("dn_c=0.25", "dn_c=0.25"),
    "preduce": ("P=9", "P=9"),  # more than the topology's 4 nodes: checked against the topology
    "canary": ("sketch_bits=9", "sketch_bits=9"),
    "ssp": ("s=three", "s=three"),
    "dssp": ("s_upper=1", "s_upper=1"),  # below s_lower = 3
    "elastic_bsp": ("search=nope", "search=nope"),
}


def test_every_registered_strategy_has_a_bad_option_case():
    # the package's strategies (tests register throwaway ones, e.g. 'test-grad-ready', in the same process)
    shipped = [name for name, cls in REGISTRY.items() if cls.__module__.startswith("p2psync.")]
    assert sorted(BAD) == sorted(shipped)


@pytest.mark.parametrize("strategy", sorted(BAD))
def test_a_bad_option_exits_2_before_anything_starts(strategy, tmp_path):
    opt, names = BAD[strategy]
    out = tmp_path / "runs"
    r = subprocess.run([sys.executable, "-m", "p2psync", "run", "topologies/ring-4.json", "--strategy", strategy,
                        "--opt", opt, "--steps", "1", "--out", str(out)],
                       capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert r.returncode == 2, r.stderr
    err = r.stderr.strip().splitlines()
    assert len(err) == 1 and names in err[0], err
    assert not out.exists()  # nothing started: no run folder


def test_dilocos_schedule_is_checked_against_a_language_models_fragments_before_anything_starts(tmp_path):
    """lm-tiny with fragments=2 is synchronized as 3 fragments (its blocks in 2 groups and its
    embeddings, final norm and output layer): inner_steps=50 ends ``p2psync run`` with exit 2
    and one line naming what the user set and the extra fragment, before any node starts."""
    out = tmp_path / "runs"
    r = subprocess.run([sys.executable, "-m", "p2psync", "run", "topologies/ring-4.json", "--strategy", "diloco",
                        "--model", "lm-tiny", "--opt", "inner_steps=50", "--opt", "fragments=2", "--steps", "1",
                        "--out", str(out)], capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert r.returncode == 2, r.stderr
    err = r.stderr.strip().splitlines()
    assert len(err) == 1 and "--opt inner_steps=50: with fragments=2" in err[0] and "3 fragments" in err[0], err
    assert "embeddings" in err[0] and "fragments (3)" not in err[0]
    assert not out.exists()

"""Shared K/V scoring equals the training-style call that recomputes the user side per candidate."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from models.config import RankerConfig
from models.inference import onednn
from models.inference.bundle import build_model
from models.training.batch import Candidates, Events, Profile
from serving.scorer import UserInputs, score_recompute, score_shared, user_tokens

VOCAB = {
    "ad_id": 50,
    "advertiser_id": 6,
    "category_id": 5,
    "action": 8,
    "surface": 5,
    "gender": 3,
    "country": 4,
}


def _ranker(use_user_tokens: bool, pooling: str = "target"):
    torch.manual_seed(0)
    cfg = RankerConfig(d_model=16, num_layers=2, num_heads=2, ffn_mult=2, num_user_tokens=2,
                       use_user_tokens=use_user_tokens, pooling=pooling)  # fmt: skip
    model = build_model("ranker", cfg, VOCAB, 3, 8 if use_user_tokens else 0).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.2)
    return model


def _user(n_events: int, tokens: bool) -> UserInputs:
    g = torch.Generator().manual_seed(1)

    def ints(high):
        return torch.randint(0, high, (n_events,), generator=g)

    events = Events(ints(50), ints(8), ints(5), ints(5), ints(6), torch.arange(n_events) * 60, ints(20),
                    torch.tensor([0, n_events]))  # fmt: skip
    profile = Profile(torch.tensor([3]), torch.tensor([1]), torch.tensor([2]), torch.tensor([[0.3]]))
    emb = torch.randn(1, 2, 8, generator=g) if tokens else None
    return UserInputs(events, profile, emb)


def _cands(n: int) -> Candidates:
    g = torch.Generator().manual_seed(2)
    return Candidates(
        ad_id=torch.randperm(max(n, 60), generator=g)[:n]
        % 60,  # includes ids beyond the vocabulary (OOV row)
        advertiser_id=torch.randint(-1, 6, (n,), generator=g),
        category_id=torch.randint(0, 5, (n,), generator=g),
        surface=torch.full((n,), 2),
        dense=torch.randn(n, 3, generator=g),
        offsets=torch.tensor([0, n]),
    )


@pytest.mark.parametrize(
    ("tokens", "n_events", "pooling"),
    [(True, 12, "target"), (False, 5, "target"), (True, 0, "target"), (True, 7, "din")],
)
def test_shared_kv_equals_per_candidate_recompute(tokens, n_events, pooling):
    ranker = _ranker(tokens, pooling)
    user, cands = _user(n_events, tokens), _cands(40)
    shared = score_shared(ranker, user, cands, batch_size=16)  # 3 batches share one user side
    recomputed = score_recompute(ranker, user, cands)
    assert shared.shape == (40, 2)
    np.testing.assert_allclose(shared, recomputed, atol=1e-5, rtol=0)
    assert shared[:, 0].std() > 1e-3  # the candidates really are scored differently


def test_shared_kv_equals_recompute_on_the_onednn_path():
    """Batches of at least ``onednn.MIN_ROWS`` candidates take the oneDNN GEMMs (``models.inference.onednn``)."""
    ranker = _ranker(True, "target")
    user, cands = _user(12, True), _cands(300)
    assert onednn.MIN_ROWS <= 256 and onednn.AVAILABLE
    shared = score_shared(ranker, user, cands, batch_size=256)  # 256 + 44: both paths in one request
    np.testing.assert_allclose(shared, score_recompute(ranker, user, cands), atol=1e-5, rtol=0)


def test_user_tokens_are_refused_when_unusable():
    ranker = _ranker(True)
    assert user_tokens(None, ranker) == (None, "no_embedding")
    assert user_tokens(np.zeros(5, np.float32), ranker)[1] == "embedding_width_5_expected_16"
    bad = np.full(16, np.nan, np.float32)
    assert user_tokens(bad, ranker)[1] == "embedding_not_finite"
    tokens, why = user_tokens(np.arange(16, dtype=np.float32), ranker)
    assert why is None and tokens.shape == (1, 2, 8)
    assert user_tokens(np.zeros(16, np.float32), _ranker(False))[1] == "ranker_uses_no_embedding"


def test_a_cancelled_request_stops_between_batches():
    """``check`` runs before every batch: a request whose deadline passed scores no further batch."""
    ranker, user, cands = _ranker(True), _user(6, True), _cands(40)
    calls = []

    def check():
        calls.append(1)
        if len(calls) > 1:  # the deadline passes after the first batch
            raise TimeoutError

    with pytest.raises(TimeoutError):
        score_shared(ranker, user, cands, batch_size=16, check=check)
    assert len(calls) == 2  # batch 1 scored, batch 2 refused, batch 3 never reached


def test_the_server_loads_and_scripts_its_model_without_torchrec(world):
    """A served ranker's tables are plain modules (``models.architectures.tokenizer.PlainTables``): the server process never
    imports torchrec (~215 MB of its memory: torchrec, fbgemm and what they pull in)."""
    import subprocess
    import sys

    probe = (
        "import sys\n"
        "import serving.server\n"
        "from serving.model_source import load_served_model\n"
        f"served = load_served_model({str(world.model_path)!r})\n"
        "assert served.ranker.script_one_user() is not None\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('torchrec', 'fbgemm_gpu')))\n"
    )
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "[]"

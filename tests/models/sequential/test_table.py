"""What ``bench/sequential.py``'s table says each row trained as."""

from __future__ import annotations

from bench.sequential import run_shape


def _cfg(model: str, loss: str, precision: str) -> dict:
    return {
        "model": model,
        "user_model": {"d_model": 256},
        "sasrec": {"d_model": 128},
        "next_item": {"loss": loss, "loss_precision": precision, "full_softmax_max_items": 1000},
    }


def test_a_row_names_its_width_and_a_low_precision_full_softmax():
    assert run_shape(_cfg("user", "auto", "fp32"), 500) == "d 256"
    assert run_shape(_cfg("user", "auto", "bf16"), 500) == "d 256, bf16 loss GEMMs"
    assert run_shape(_cfg("sasrec", "full", "bf16"), 5000) == "d 128, bf16 loss GEMMs"
    # the precision only applies to the full softmax: not to sampled losses, nor to auto past its item limit
    assert run_shape(_cfg("sasrec", "sampled", "bf16"), 500) == "d 128"
    assert run_shape(_cfg("user", "auto", "bf16"), 5000) == "d 256"


def _row(value: float, *, trained: bool = True, also: float | None = None) -> dict:
    """A table row with every test metric at ``value`` (and its kept-on-sampled state's at ``also``)."""
    from bench.sequential_report import METRICS, PROTOCOLS

    row = {f"test_{p}{m}": value for p in PROTOCOLS.values() for m in METRICS}
    if trained:
        row |= {"epoch_cap": 300, "epochs": 20, "stopped_early": True, "select_metric": "full_ndcg@10"}
        row |= {"also_select_metric": "ndcg@10" if also is not None else ""}
    if also is not None:
        row |= {f"also_test_{m}": also for m in METRICS}
    return row


def test_the_sampled_protocol_with_its_own_selection_is_a_block_of_its_own():
    from bench.sequential_report import markdown, summarize

    per_seed = {
        s: {
            "popularity": _row(0.1, trained=False),
            "gemflow": _row(0.5, also=0.6),
            "sasrec": _row(0.4, also=0.55),
        }
        for s in (0, 1)
    }
    summary = summarize(per_seed)
    assert summary["views"] == ["sampled", "masked", "unmasked", "sampled_own"]
    table = summary["table"]
    assert (
        table["gemflow"]["sampled_own_hr@10"]["mean"] == 0.6
        and table["gemflow"]["sampled_hr@10"]["mean"] == 0.5
    )
    assert table["popularity"]["sampled_own_hr@10"]["mean"] == 0.1  # never selected: its one ranking
    assert summary["every_seed"]["gemflow > sasrec"]["sampled_own_ndcg@10"]
    text = markdown(summary, "t", "cmd")
    assert "**sampled, each run's state chosen on its valid sampled NDCG@10" in text
    assert "NDCG@10 (full ranking, masked); also kept: NDCG@10 (sampled)" in text
    for block in text.split("\n\n"):  # every row of every markdown table has its header's columns
        rows = [line for line in block.splitlines() if line.startswith("|")]
        assert len({row.count("|") for row in rows}) <= 1, rows
    # one trained run without such a state: no block, rather than a block that mixes selections
    per_seed[1]["sasrec"] = _row(0.4)
    assert "sampled_own" not in summarize(per_seed)["views"]

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

"""Published figures of the next-item sets, each with the protocol it was measured under, printed beside
bench/sequential.py's table (the sampled ones are S3-Rec's Table 2 (CIKM 2020) as /work/shared/data/amazon-s3rec/SOURCE.md records it, the
masked full-ranking ones as quoted in issue 36; a set without a recorded anchor prints none). The published
sampled figures used fixed negative files that are not in our copy: ours are our own 99 per user.

Protocols: ``sampled`` = 1 positive + 99 sampled negatives (S3-Rec's, what our sampled rows measure);
``full, masked`` = every item, the user's history excluded (our masked full-ranking rows).
"""

from __future__ import annotations

# dataset key (matched against the training set's name, case-insensitive) -> (model, protocol, HR@10, NDCG@10)
PUBLISHED: dict[str, list[tuple[str, str, float | None, float | None]]] = {
    "sports": [
        ("SASRec, paper loss (S3-Rec Table 2)", "sampled", 0.4622, 0.2869),
        ("S3-Rec (S3-Rec Table 2)", "sampled", 0.5614, 0.3538),
        ("SASRec + sampled softmax, 256 negatives", "full, masked", 0.0569, 0.0314),
        ("eSASRec (RecSys 2025)", "full, masked", 0.0560, 0.0323),
    ],
    "toys": [
        ("SASRec, paper loss (S3-Rec Table 2)", "sampled", 0.4663, 0.3136),
        ("S3-Rec (S3-Rec Table 2)", "sampled", 0.5530, 0.3629),
        ("SASRec + sampled softmax, 256 negatives", "full, masked", 0.0970, 0.0580),
        ("eSASRec (RecSys 2025)", "full, masked", 0.0939, 0.0538),
        ("HSTU, re-run under the same protocol", "full, masked", 0.0778, 0.0450),
    ],
}


def anchors_for(name: str) -> list[tuple[str, str, float | None, float | None]]:
    key = name.lower()
    return [row for k, rows in PUBLISHED.items() if k in key for row in rows]


def anchor_lines(name: str) -> list[str]:
    rows = anchors_for(name)
    if not rows:
        return ["No published anchor recorded for this set (bench/sequential_anchors.py).", ""]

    def cell(v):
        return "—" if v is None else f"{v:.4f}"

    lines = ["**Published anchors** (their protocol named)", "", "| model | protocol | HR@10 | NDCG@10 |"]
    lines.append("|---|---|---:|---:|")
    lines += [f"| {m} | {p} | {cell(h)} | {cell(n)} |" for m, p, h, n in rows]
    return lines + [""]

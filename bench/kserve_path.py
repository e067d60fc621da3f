"""The ranker served through KServe's public path, to compare with ours (issue 40): the same ``RankerPredictor``,
loaded the same way, behind KServe's own FastAPI app and data plane (V1 ``:predict`` reaches
``RankerPredictor.predict``), served by uvicorn on 127.0.0.1; no gateway, so none of its limits, deadlines or
error shapes. Start it beside ``gemflow serve`` on the same bench world and compare the two with serve_ab:

    .venv/bin/python bench/serve.py --build-world /tmp/gemflow-bench          # once: the bench world
    .venv/bin/python -m gemflow.cli serve --workspace /tmp/gemflow-bench/ws --model-uri /tmp/gemflow-bench/ranker \\
        --http-port 18091 --set limits.max_candidates=5000 &
    .venv/bin/python bench/kserve_path.py --workspace /tmp/gemflow-bench/ws --model-uri /tmp/gemflow-bench/ranker \\
        --http-port 18092 --set limits.max_candidates=5000 &
    .venv/bin/python bench/serve_ab.py --ports 18091,18092 --labels gateway,kserve-public --rounds 8 --record
"""

from __future__ import annotations

import argparse
from pathlib import Path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workspace", type=Path, required=True)
    ap.add_argument("--model-uri", required=True)
    ap.add_argument("--http-port", type=int, default=18092)
    ap.add_argument(
        "--set", action="append", default=[], help="ServingConfig override key=value (repeatable)"
    )
    args = ap.parse_args()

    from gemflow.commands.common import config, workspace
    from serving.config import ServingConfig
    from serving.pauses import freeze_heap
    from serving.predictor import RankerPredictor
    from serving.server import kserve_app, run_server

    cfg = config(
        ServingConfig, None, args.set, host="127.0.0.1", http_port=args.http_port, model_uri=args.model_uri
    )
    predictor = RankerPredictor(cfg, workspace(args.workspace))
    predictor.load()
    freeze_heap()  # as serving.server.serve does after loading
    try:
        run_server(cfg, kserve_app(predictor))
    finally:
        predictor.stop()


if __name__ == "__main__":
    main()

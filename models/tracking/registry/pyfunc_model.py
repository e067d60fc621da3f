"""MLflow "models from code" entry for every gemflow model: no pickle anywhere.

MLflow executes this file on load; the model comes from the logged ``model.pt`` bundle (config, vocabulary,
dense normalization and weights as plain tensors) read with ``torch.load(weights_only=True)``. ``predict`` takes
rows in the format of ``models.tracking.registry.flat`` and returns p_click / p_conversion (and, for the user model, the
cached user embedding each row's history yields).
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import mlflow
import numpy as np
import pandas as pd
import torch
from mlflow.pyfunc import PythonModel

from models.inference.bundle import embed_examples, load_bundle, predict
from models.tracking.registry.flat import to_training_set
from models.tracking.registry.scoring import batch_builder


class GemModel(PythonModel):
    def load_context(self, context) -> None:
        self.bundle = load_bundle(Path(context.artifacts["bundle"]))
        self.model = self.bundle.model
        b = self.bundle
        # what servers read without touching internals (serving.model_source)
        self.spec = {
            "kind": b.kind,
            "model_config": {
                "dense": {"columns": b.dense.columns, "mean": b.dense.mean, "std": b.dense.std},
                "version": b.version,
                "user_model_version": b.user_model_version,
            },
        }

    def predict(self, context, model_input: pd.DataFrame, params=None) -> pd.DataFrame:
        with tempfile.TemporaryDirectory() as tmp, torch.no_grad():
            data = to_training_set(pd.DataFrame(model_input), Path(tmp))
            rows = np.arange(len(data.examples))
            probs = predict(self.model, batch_builder(self.bundle, data), rows, batch_size=1024)
            out = pd.DataFrame({"p_click": probs[:, 0], "p_conversion": probs[:, 1]})
            if self.bundle.kind == "user":
                out["user_embedding"] = list(embed_examples(self.bundle, data))
            return out


mlflow.models.set_model(GemModel())

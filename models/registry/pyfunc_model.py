"""MLflow "models from code" entry: rebuilds a gemflow torch model from its config and a state dict.

MLflow executes this file when loading (no pickle anywhere): the architecture comes from a factory in our own
``models`` package named in the logged config, the weights from ``torch.load(weights_only=True)``.
"""

from __future__ import annotations

import importlib
import json
from pathlib import Path

import mlflow
import torch
from mlflow.pyfunc import PythonModel

TRUSTED_PREFIX = "models."  # a logged config may only name factories inside our package


def resolve(path: str):
    module, _, name = path.partition(":")
    if not module.startswith(TRUSTED_PREFIX) or not name:
        raise ValueError(f"refusing to import {path!r}: factories must be 'models.<module>:<function>'")
    return getattr(importlib.import_module(module), name)


class TorchStateDictModel(PythonModel):
    def load_context(self, context) -> None:
        spec = json.loads(Path(context.artifacts["spec"]).read_text())
        self.spec = spec
        self.model = resolve(spec["factory"])(spec["model_config"])
        state = torch.load(context.artifacts["weights"], map_location="cpu", weights_only=True)
        self.model.load_state_dict(state)
        self.model.eval()
        self._predict = resolve(spec["predict"])

    def predict(self, context, model_input, params=None):
        with torch.no_grad():
            return self._predict(self.model, model_input)


mlflow.models.set_model(TorchStateDictModel())

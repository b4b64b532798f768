"""A KServe V2 model for MLServer that sums each row, fails a batch holding a malformed
row (a negative value) as real models do (MLServer answers 500), and takes its time over a
row holding 999 (so that a test can keep it busy)."""

import asyncio

from mlserver import MLModel
from mlserver.codecs import NumpyCodec
from mlserver.types import InferenceRequest, InferenceResponse


class RowSum(MLModel):
    async def load(self) -> bool:
        return True

    async def predict(self, payload: InferenceRequest) -> InferenceResponse:
        rows = NumpyCodec.decode_input(payload.inputs[0])
        if (rows < 0).any():
            raise ValueError("malformed row: a negative value")
        if (rows == 999).any():
            await asyncio.sleep(0.5)
        return InferenceResponse(
            model_name=self.name,
            outputs=[NumpyCodec.encode_output("sum", rows.sum(axis=1, keepdims=True))],
        )

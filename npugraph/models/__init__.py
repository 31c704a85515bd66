"""A small decoder and a continuous-batching workload to prove the runtime on."""

from npugraph.models.llama import Decoder, DecoderConfig, MLADecoder
from npugraph.models.workload import Request, StepBatch, Workload

__all__ = ["Decoder", "MLADecoder", "DecoderConfig", "Request", "StepBatch", "Workload"]

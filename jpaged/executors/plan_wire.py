"""A StepPlan as bytes and back: what process 0 sends its followers each step (jpaged.executors.remote).

A follower runs the same jitted step as process 0, so it needs every field the executor reads: the
device arrays, the block-op pairs, the scalar counts and the sampling batch (`SamplingBatch`, the
rows' settings as arrays) and the prompt rows (`PromptRows`: their token rows, targets and top k,
which change the step's shapes). It never needs the `Sequence` objects (`plan.seqs`,
`plan.sampling.seqs`) nor the prompt rows' requests: those stay on process 0, the only process that
applies the sampled tokens and records prompt log-probabilities.

Layout: a 4-byte big-endian header length, a JSON header, then the arrays' raw bytes back to back.
The header lists the scalars by field name and, for each array, its field, dtype, shape and byte
count. No pickle: a follower decodes only numbers, whatever reaches its socket. Fields are taken
from the dataclasses themselves, so a field added to StepPlan or SamplingBatch travels without a
change here; one of a type this format cannot carry fails on process 0 with its name, before
anything is sent.
"""

from __future__ import annotations

import dataclasses
import json
import struct

import numpy as np

from jpaged.core.step_plan import PromptRows, SamplingBatch, StepPlan

# StepPlan fields that stay on process 0 (sampling goes as its batch, prompt_rows without its requests)
_LOCAL_FIELDS = ("seqs", "sampling", "prompt_rows")
_SCALARS = (int, float, bool, str, type(None))
_HEADER = struct.Struct("!I")


@dataclasses.dataclass
class RemoteRows:
    """What a follower knows of the plan's sample rows: their settings as arrays, nothing else.

    Stands in for `SampleRows` in a decoded plan (the executor reads only `.batch` and the row count).
    """

    batch: SamplingBatch

    def __len__(self) -> int:
        return len(self.batch.logits_rows)


def _fields(obj, skip: tuple[str, ...], prefix: str) -> tuple[dict, list[tuple[str, np.ndarray]]]:
    """Scalars by name and (name, array) pairs of a dataclass; TypeError names a field of another type."""
    scalars, arrays = {}, []
    for field in dataclasses.fields(obj):
        if field.name in skip:
            continue
        value = getattr(obj, field.name)
        if isinstance(value, np.ndarray):
            arrays.append((field.name, np.ascontiguousarray(value)))
        elif isinstance(value, (np.integer, np.floating)):
            scalars[field.name] = value.item()
        elif isinstance(value, _SCALARS):
            scalars[field.name] = value
        else:
            raise TypeError(f"{prefix}{field.name}: a {type(value).__name__} cannot be sent to the other processes "
                            f"(plan_wire carries numpy arrays and plain scalars)")
    return scalars, arrays


def encode_plan(plan: StepPlan) -> list[bytes | memoryview]:
    """`plan` as a list of buffers to send back to back (header, then each array's bytes, uncopied).

    Builds `plan.sampling.batch` first: a request whose sampling settings cannot become arrays
    raises here, before anything reaches a follower (the engine then retries without its rows).
    """
    scalars, arrays = _fields(plan, _LOCAL_FIELDS, "plan.")
    header: dict = {"plan": scalars, "arrays": []}
    if plan.sampling is not None:
        batch_scalars, batch_arrays = _fields(plan.sampling.batch, (), "plan.sampling.batch.")
        header["batch"] = batch_scalars
        arrays += [(f"batch.{name}", array) for name, array in batch_arrays]
    if plan.prompt_rows is not None:
        rows = plan.prompt_rows
        header["prompt_rows"] = {"num_top": int(rows.num_top)}
        arrays += [("prompt_rows.token_rows", np.ascontiguousarray(rows.token_rows)),
                   ("prompt_rows.targets", np.ascontiguousarray(rows.targets))]
    header["arrays"] = [[name, array.dtype.str, list(array.shape), array.nbytes] for name, array in arrays]
    head = json.dumps(header, separators=(",", ":")).encode()
    return [_HEADER.pack(len(head)), head, *(memoryview(array).cast("B") for _, array in arrays if array.nbytes)]


def decode_plan(data: bytes | memoryview) -> StepPlan:
    """The StepPlan `encode_plan` wrote (its sampling a `RemoteRows`, its `seqs` and its prompt rows'
    `groups` empty).

    ValueError when the bytes do not hold a whole plan (a truncated or foreign message).
    """
    data = memoryview(data)
    if len(data) < _HEADER.size:
        raise ValueError(f"plan message: {len(data)} bytes, shorter than its header")
    (size,) = _HEADER.unpack_from(data)
    try:
        header = json.loads(bytes(data[_HEADER.size: _HEADER.size + size]))
    except ValueError as exc:
        raise ValueError(f"plan message: its header is not JSON ({exc})") from None
    offset = _HEADER.size + size
    plan_fields, batch_fields, prompt_fields = dict(header["plan"]), header.get("batch"), header.get("prompt_rows")
    for name, dtype, shape, nbytes in header["arrays"]:
        if offset + nbytes > len(data):
            raise ValueError(f"plan message: array {name} needs {nbytes} bytes at {offset}, the message has {len(data)}")
        # A copy: arrays at arbitrary offsets of the message are unaligned; the copies are aligned.
        array = np.frombuffer(data[offset: offset + nbytes], dtype=np.dtype(dtype)).reshape(shape).copy()
        offset += nbytes
        if name.startswith("batch."):
            batch_fields[name[len("batch."):]] = array
        elif name.startswith("prompt_rows."):
            prompt_fields[name[len("prompt_rows."):]] = array
        else:
            plan_fields[name] = array
    if offset != len(data):
        raise ValueError(f"plan message: {len(data) - offset} bytes left over after the last array")
    sampling = RemoteRows(SamplingBatch(**batch_fields)) if batch_fields is not None else None
    prompt_rows = PromptRows(**prompt_fields, groups=[]) if prompt_fields is not None else None
    return StepPlan(**plan_fields, sampling=sampling, prompt_rows=prompt_rows)

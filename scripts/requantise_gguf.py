"""Write a copy of a GGUF file with its matrices stored in another block type (metadata and
vectors unchanged): the packaged SmolLM2 Q4_1 file as Q4_0, Q8_0, F16, ... to measure what
each decode-weight path costs (README "Your model").

    python scripts/requantise_gguf.py SOURCE.gguf TARGET.gguf Q8_0
"""

from __future__ import annotations

import sys

import gguf
import numpy as np


def requantise(source: str, target: str, kind_name: str) -> None:
    reader = gguf.GGUFReader(source)
    kind = gguf.GGMLQuantizationType[kind_name]
    architecture = bytes(reader.fields["general.architecture"].parts[-1]).decode()
    writer = gguf.GGUFWriter(target, architecture)
    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or key in ("general.architecture", "general.file_type"):
            continue
        value_type = field.types[0]
        if value_type == gguf.GGUFValueType.ARRAY:
            sub_type = field.types[-1]
            if sub_type == gguf.GGUFValueType.STRING:
                values = [bytes(field.parts[i]).decode() for i in field.data]
            else:
                values = [field.parts[i].tolist()[0] for i in field.data]
            writer.add_key_value(key, values, value_type, sub_type=sub_type)
        elif value_type == gguf.GGUFValueType.STRING:
            writer.add_key_value(key, bytes(field.parts[field.data[0]]).decode(), value_type)
        else:
            writer.add_key_value(key, field.parts[field.data[0]].tolist()[0], value_type)
    for tensor in reader.tensors:
        weights = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
        if weights.ndim == 2 and kind != gguf.GGMLQuantizationType.F32:
            writer.add_tensor(tensor.name, gguf.quants.quantize(weights, kind), raw_dtype=kind)
        else:
            writer.add_tensor(tensor.name, np.ascontiguousarray(weights, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


if __name__ == "__main__":
    requantise(*sys.argv[1:4])

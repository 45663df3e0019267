"""Tensor dtypes that travel on the wire, and a tagged array for dtypes numpy lacks.

Agora's trainer and tools never import torch, so tensors are numpy arrays. ``bfloat16`` has no
numpy dtype: it travels as little-endian 2-byte words inside a :class:`TaggedArray` whose
``words`` array is ``uint16``; workers reinterpret those words as ``torch.bfloat16`` without
touching the bits, so a round trip is bit-exact.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Union

import numpy as np

# wire name -> little-endian storage dtype. The storage dtype of a "native" name is the name.
_STORAGE: dict[str, np.dtype] = {
    "bool": np.dtype("?"),
    "uint8": np.dtype("u1"),
    "int8": np.dtype("i1"),
    "uint16": np.dtype("<u2"),
    "int16": np.dtype("<i2"),
    "uint32": np.dtype("<u4"),
    "int32": np.dtype("<i4"),
    "uint64": np.dtype("<u8"),
    "int64": np.dtype("<i8"),
    "float16": np.dtype("<f2"),
    "float32": np.dtype("<f4"),
    "float64": np.dtype("<f8"),
    "complex64": np.dtype("<c8"),
    "complex128": np.dtype("<c16"),
    "bfloat16": np.dtype("<u2"),
}
# Names numpy has no dtype for; they decode to TaggedArray rather than a plain ndarray.
_TAGGED_ONLY = frozenset({"bfloat16"})

SUPPORTED_DTYPES: tuple[str, ...] = tuple(_STORAGE)


def storage_dtype(name: str) -> np.dtype:
    """The little-endian numpy dtype that holds ``name``'s bytes; KeyError if unsupported."""
    return _STORAGE[name]


def itemsize(name: str) -> int:
    return _STORAGE[name].itemsize


def is_tagged_only(name: str) -> bool:
    return name in _TAGGED_ONLY


@dataclass(frozen=True, eq=False)
class TaggedArray:
    """An array whose element type is named by ``dtype`` and stored bit-for-bit in ``words``.

    ``words`` has the storage dtype of ``dtype`` (``uint16`` for ``bfloat16``) and the logical
    shape of the tensor. Use it for dtypes numpy cannot represent, or to send a raw buffer
    with an explicit tag.
    """

    dtype: str
    words: np.ndarray

    def __post_init__(self) -> None:
        if self.dtype not in _STORAGE:
            raise TypeError(f"unsupported dtype {self.dtype!r}; supported: {', '.join(_STORAGE)}")
        want = _STORAGE[self.dtype]
        if self.words.dtype.itemsize != want.itemsize or self.words.dtype.kind not in "biufc?":
            raise TypeError(
                f"{self.dtype} words must be {want.itemsize}-byte elements, got {self.words.dtype}"
            )

    @classmethod
    def from_buffer(cls, dtype: str, shape: tuple[int, ...], buffer) -> TaggedArray:
        """Wrap a raw little-endian buffer (bytes, memoryview, torch storage view, ...)."""
        if dtype not in _STORAGE:
            raise TypeError(f"unsupported dtype {dtype!r}")
        words = np.frombuffer(buffer, dtype=_STORAGE[dtype])
        count = int(np.prod(shape, dtype=np.int64)) if shape else 1
        if words.size != count:
            raise ValueError(
                f"buffer holds {words.size} {dtype} elements but shape {tuple(shape)} needs {count}"
            )
        return cls(dtype, words.reshape(shape))

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.words.shape)

    @property
    def nbytes(self) -> int:
        return int(self.words.nbytes)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, TaggedArray):
            return NotImplemented
        return (
            self.dtype == other.dtype
            and self.shape == other.shape
            and self.words.view(np.uint8).tobytes() == other.words.view(np.uint8).tobytes()
        )

    def __repr__(self) -> str:
        return f"TaggedArray(dtype={self.dtype!r}, shape={self.shape})"


Tensor = Union[np.ndarray, TaggedArray]


def bfloat16_to_float32(words: np.ndarray) -> np.ndarray:
    """bf16 is the top half of a float32: widen the bits, exactly."""
    return (words.astype(np.uint32) << 16).view(np.float32)


def as_float32(tensor: Tensor) -> np.ndarray:
    """A floating tensor's values as float32, a bf16 one widened exactly (for comparisons)."""
    if isinstance(tensor, TaggedArray):
        if tensor.dtype != "bfloat16":
            raise TypeError(f"a {tensor.dtype} tagged array holds no floats this reads")
        return bfloat16_to_float32(tensor.words)
    return np.asarray(tensor, dtype=np.float32)


# (kind, itemsize) of a numpy dtype -> its wire name: one lookup per tensor on the hot path
_NAME_BY_KIND_SIZE: dict[tuple[str, int], str] = {}
for _name, _storage in _STORAGE.items():
    if _name not in _TAGGED_ONLY:
        _NAME_BY_KIND_SIZE.setdefault((_storage.kind, _storage.itemsize), _name)


def dtype_name_of(array: np.ndarray) -> str:
    """The wire name of a numpy array's dtype; TypeError for dtypes that cannot travel."""
    name = _NAME_BY_KIND_SIZE.get((array.dtype.kind, array.dtype.itemsize))
    if name is None:
        raise TypeError(
            f"numpy dtype {array.dtype} cannot travel on the wire; supported: {', '.join(_STORAGE)}"
        )
    return name


def as_wire_array(tensor: Tensor) -> tuple[str, np.ndarray]:
    """(wire dtype name, C-contiguous little-endian storage array) for any accepted tensor."""
    if isinstance(tensor, TaggedArray):
        name, array = tensor.dtype, tensor.words
    elif isinstance(tensor, np.ndarray):
        name, array = dtype_name_of(tensor), tensor
    else:
        raise TypeError(f"a tensor must be a numpy.ndarray or TaggedArray, got {type(tensor).__name__}")
    if array.dtype.byteorder == ">":  # the wire is little-endian
        array = array.astype(array.dtype.newbyteorder("<"))
    if not array.flags.c_contiguous:  # (np.ascontiguousarray would turn 0-d into 1-d)
        array = array.copy(order="C")
    storage = _STORAGE[name]
    if array.dtype != storage:  # e.g. int16 words tagged bfloat16: same bits, storage view
        array = array.view(storage)
    return name, array

"""Content-addressed artifacts: chunking, the manifest model and codec, scan, plan, materialise.

Pure library (no trio, no network). Public API:

- chunking: ``ChunkerParams``, ``ChunkRef``, ``chunk_file``, ``chunk_buffer``
- model: ``Manifest`` (``.id``, ``.entries``, ``.chunks``), ``Entry``, ``Chunk``, ``ManifestBuilder``,
  limits (``MAX_*``), ``MANIFEST_VERSION``
- codec: ``encode_manifest``, ``decode_manifest``, ``manifest_id``, ``to_json_view``
- validate: ``validate_manifest``
- scan: ``scan_tree`` -> ``ScanResult(.manifest, .sources)``, ``ChunkSource``
- plan: ``plan`` -> ``Plan``, ``LinkOp``; ``diff`` -> ``Diff``
- materialise: ``materialise``, ``MaterialiseStats``, ``remove_partials``, ``is_partial``
- errors: ``ManifestError``, ``IntegrityError``, ``ChunkerUnavailable``, ``ChunkMissing``

The functions ``plan`` and ``materialise`` shadow their submodules as package attributes:
``import manifests.plan as m`` gives the function; use ``from manifests.plan import diff`` style.
"""

from .chunking import ChunkRef, check_chunker, chunk_buffer, chunk_file
from .codec import decode_manifest, encode_manifest, manifest_id, to_json_view
from .errors import ChunkerUnavailable, ChunkMissing, IntegrityError, ManifestError
from .materialise import MaterialiseStats, is_partial, materialise, remove_partials
from .model import (
    MANIFEST_VERSION,
    MAX_CHUNKS,
    MAX_ENTRIES,
    MAX_MANIFEST_BYTES,
    MAX_PATH_BYTES,
    Chunk,
    ChunkerParams,
    Entry,
    Manifest,
    ManifestBuilder,
)
from .plan import Diff, LinkOp, Plan, diff, plan
from .scan import ChunkSource, ScanResult, scan_tree
from .validate import validate_manifest

__all__ = [
    "MANIFEST_VERSION",
    "MAX_CHUNKS",
    "MAX_ENTRIES",
    "MAX_MANIFEST_BYTES",
    "MAX_PATH_BYTES",
    "Chunk",
    "Diff",
    "LinkOp",
    "MaterialiseStats",
    "Plan",
    "ChunkMissing",
    "ChunkRef",
    "ChunkSource",
    "ChunkerParams",
    "ChunkerUnavailable",
    "Entry",
    "IntegrityError",
    "Manifest",
    "ManifestBuilder",
    "ManifestError",
    "ScanResult",
    "check_chunker",
    "chunk_buffer",
    "chunk_file",
    "decode_manifest",
    "diff",
    "is_partial",
    "materialise",
    "plan",
    "remove_partials",
    "encode_manifest",
    "manifest_id",
    "scan_tree",
    "to_json_view",
    "validate_manifest",
]

"""The artifact layer: the versioned files every stage talks through. stdlib + pyyaml only."""

from spindle_cli.artifacts.canonical import rendered_for, sha256
from spindle_cli.artifacts.cluster import ClusterSpec, DeviceSpec
from spindle_cli.artifacts.files import write_artifact
from spindle_cli.artifacts.graph import MetaOp, MetaOpGraph
from spindle_cli.artifacts.io import (
    PRODUCER,
    derived_header,
    input_ref,
    kinds,
    load,
    load_artifact,
    load_recorded_input,
)
from spindle_cli.artifacts.model import ModelSpec
from spindle_cli.artifacts.plan import Plan
from spindle_cli.artifacts.profile import Profile

__all__ = [
    "PRODUCER",
    "ClusterSpec",
    "DeviceSpec",
    "MetaOp",
    "MetaOpGraph",
    "ModelSpec",
    "Plan",
    "Profile",
    "derived_header",
    "input_ref",
    "kinds",
    "load",
    "load_artifact",
    "load_recorded_input",
    "rendered_for",
    "sha256",
    "write_artifact",
]

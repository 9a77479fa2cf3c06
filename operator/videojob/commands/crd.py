"""`videojob crd`: print or write the VideoJob CRD generated from the API models."""

from __future__ import annotations

import argparse
from pathlib import Path

from ..crd import render_crd
from .common import _emit

def _cmd_crd(args: argparse.Namespace) -> int:
    text = render_crd()
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(text)
    else:
        _emit(text.rstrip("\n"))
    return 0

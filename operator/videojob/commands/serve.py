"""`videojob operator`: serve the VideoJob operator (kopf) that plans, queues and
runs jobs on Ray."""

from __future__ import annotations

import argparse
import sys

from .common import EXIT_BAD_INPUT, EXIT_OK

def _cmd_operator(args: argparse.Namespace) -> int:
    """kopf inside: watch VideoJobs and run them on Ray."""
    import logging

    from pydantic import ValidationError

    from ..settings import OperatorSettings

    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        settings = OperatorSettings()
    except ValidationError as exc:
        for error in exc.errors():
            print(f"operator: VIDEOJOB_{'_'.join(map(str, error['loc'])).upper()}: {error['msg']}", file=sys.stderr)
        return EXIT_BAD_INPUT
    namespaces = list(args.namespace or []) or ([] if args.all_namespaces else settings.namespaces)
    from ..controller.handlers import run

    run(settings, namespaces, standalone=args.standalone)
    return EXIT_OK

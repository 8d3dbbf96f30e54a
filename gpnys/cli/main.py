"""Entry point of the ``gpnys`` console script. Subcommands register themselves from :data:`SUBCOMMANDS`."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from typing import NoReturn

import torch.distributed as dist

from gpnys import distributed as gpnys_distributed
from gpnys.budget import memory_budget
from gpnys.cli import classify, fit, mll, pcg, reduce
from gpnys.cli.common import NUMERICAL_ERRORS, SHARED_FLAGS, check_flags, failure_message, parse_device
from gpnys.collectives import CollectiveError

#: modules with ``NAME``, ``HELP``, ``FLAGS`` (their flags' :class:`gpnys.cli.common.Range` by destination),
#: ``add_parser(parser)`` and ``run(args) -> int``
SUBCOMMANDS = [fit, pcg, mll, reduce, classify]


class OneLineParser(argparse.ArgumentParser):
    """argparse's parser with its errors on one line, ``gpnys <command>: error: ...``, and exit status 2 (argparse
    prints its whole usage block first). The subcommands' parsers are of this class too."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineParser(prog="gpnys", description="Fast and correct GP hyperparameter optimisation.")
    sub = parser.add_subparsers(dest="command", required=True)
    for mod in SUBCOMMANDS:
        p = sub.add_parser(mod.NAME, help=mod.HELP, description=mod.HELP)
        mod.add_parser(p)
        p.set_defaults(_run=mod.run, _flags={**SHARED_FLAGS, **mod.FLAGS})
    return parser


def budget_from_args(args: argparse.Namespace) -> dict[str, int | None]:
    """``memory_budget`` keywords from ``--block-mib`` / ``--dense-gib`` (absent or None: the defaults; their ranges
    are checked by :func:`gpnys.cli.common.check_flags`)."""
    mib, gib = getattr(args, "block_mib", None), getattr(args, "dense_gib", None)
    return {"block_bytes": None if mib is None else mib << 20, "dense_bytes": None if gib is None else int(gib * 2**30)}


def join_torchrun(args: argparse.Namespace) -> None:
    """Under ``torchrun`` (``WORLD_SIZE > 1``): join the process group (gloo on CPU, NCCL for ``--device cuda``)
    with every rank seeded alike; the kernel is then split by rows (:mod:`gpnys.distributed`), and only rank 0
    prints."""
    if not gpnys_distributed.launched():
        return
    device = getattr(args, "device", None)
    rank, _ = gpnys_distributed.init("nccl" if device is not None and device.type == "cuda" else "gloo",
                                     seed=getattr(args, "seed", 0))
    if rank != 0:
        sys.stdout = open(os.devnull, "w")  # noqa: SIM115 - rank 0 reports, the others compute


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if extra:  # named after the subcommand they were given to, or "gpnys" for those before it
        given = list(sys.argv[1:] if argv is None else argv)
        before = given[: given.index(args.command)] if args.command in given else []
        prog = "gpnys" if any(e in before for e in extra) else f"gpnys {args.command}"
        parser.exit(2, f"{prog}: error: unrecognized arguments: {' '.join(extra)} (see --help)\n")
    try:
        check_flags(args, args._flags)
        if hasattr(args, "device"):
            args.device = parse_device(args.device)
        join_torchrun(args)
        with memory_budget(**budget_from_args(args)):
            return int(args._run(args) or 0)
    except ValueError as exc:
        parser.exit(2, f"gpnys {args.command}: error: {exc}\n")
    except CollectiveError as exc:  # another rank died or timed out: one line, as for any other error, then out
        # at once: with a peer gone, tearing the group down (or exiting with it alive) can abort in the backend's
        # destructors (SIGABRT, "terminate called without an active exception") instead of exiting with 1
        sys.stderr.write(f"gpnys {args.command}: error: {str(exc).splitlines()[0]}\n")
        sys.stderr.flush()
        sys.stdout.flush()
        os._exit(1)
    except NUMERICAL_ERRORS as exc:  # a computation that failed on its numbers or memory: one line, not a traceback
        if isinstance(exc, (NotImplementedError, RecursionError)):  # programming errors, not numerical ones
            raise
        parser.exit(2, f"gpnys {args.command}: error: {failure_message(exc, args, args._flags)}\n")
    except OSError as exc:  # a file that cannot be read, or an output that cannot be written (pipe, full disk)
        where = exc.filename if exc.filename else "standard output"
        if exc.filename is None:  # stop the interpreter's final flush from writing to the broken stream again
            sys.stdout = open(os.devnull, "w")  # noqa: SIM115
        parser.exit(2, f"gpnys {args.command}: error: {where}: {exc.strerror or exc}\n")
    finally:
        _leave_group()
    return 0


def _leave_group() -> None:
    """Destroy the process group (if this process joined one) before exiting: an interpreter exit with a live
    group can abort (SIGABRT) in the backend's teardown."""
    if dist.is_available() and dist.is_initialized():
        try:
            dist.destroy_process_group()
        except Exception:  # noqa: BLE001 (a dead peer's group may fail to tear down; the exit proceeds)
            pass


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())

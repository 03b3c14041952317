"""The ``train.py`` / ``fastpals train`` command line, generated from :class:`TrainArgs`'s fields; errors a
user can fix print one line (``--debug``: the traceback too)."""

from __future__ import annotations

import argparse
import ctypes
import ctypes.util
import dataclasses
import json
import platform
import sys
import textwrap
import threading
import traceback
from pathlib import Path
from typing import Any

from fastpals.train.args import (
    OPTION_TYPES,
    OPTIONS,
    TrainArgs,
    load_recipe,
    option_flag,
    recipe_names,
    resume_fields,
    type_problem,
)
from fastpals.train.errors import (
    ConfigError,
    NonFiniteLossError,
    OutputError,
    SetupCtrlC,
    TrainingInterrupted,
    read_json_object,
)
from fastpals.train.loop import Trainer

__all__ = ["build_parser", "keep_freed_memory", "main", "parse_args"]

PROG = "train.py"
# options of one command, never taken from the saved run on --resume
PER_INVOCATION = ("resume", "overwrite", "debug", "verbose", "local_rank", "stop_after_steps", "inject_nan_at_step",
                  "inject_nan_weights_at_step", "kill_after_steps")  # fmt: skip


#: the exit codes of ``train.py`` (also in ``--help``)
EXIT_CODES = {
    0: "the run finished",
    2: "an option, the ds_config, the data, --out or a checkpoint is wrong (one line says what to change)",
    3: "a non-finite loss, gradient or weights stopped training (nothing non-finite was saved)",
    4: "an output could not be written (disk full, no permission, read-only): the previous checkpoint is whole",
    129: "stopped by SIGHUP (a closed terminal) after writing a checkpoint: --resume continues",
    130: "stopped by Ctrl-C: once, after a checkpoint (--resume continues); twice, or during the set-up, at once",
    143: "stopped by SIGTERM after writing a checkpoint: --resume continues",
}


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # one line, not usage + error
        self.exit(2, f"{self.prog}: error: {message} (`{self.prog} --help` lists the options)\n")


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Defaults in the options' help; the epilog's lines (the exit codes) kept as written."""

    def _fill_text(self, text: str, width: int, indent: str) -> str:
        return "\n".join(
            textwrap.fill(
                line, width, initial_indent=indent, subsequent_indent=indent + " " * 7 * line[:1].isspace()
            )
            if line.strip()
            else ""
            for line in text.splitlines()
        )


def build_parser(suppress_defaults: bool = False) -> argparse.ArgumentParser:
    """The argparse parser of :class:`TrainArgs`: one option per field, its help from the field's metadata.
    ``suppress_defaults``: options not given are absent from the namespace (to tell given ones apart)."""
    may = resume_fields("may_change")
    p = _Parser(
        prog=PROG,
        description="Multi-task fine-tuning of BERT + PALs (SST, Quora, STS) with DeepSpeed. Run as `deepspeed "
        "train.py --ds_config configs/<name>.json [options]` or `python train.py [options]`.",
        epilog="[may change on --resume] marks the options a resumed run may give anew: "
        + ", ".join(_fmt(n) for n in may if not OPTIONS[n].metadata["hidden"])
        + ". --resume reads every option from <out>/train_args.json; giving one of the others with another value "
        "is an error.\n\nexit codes:\n"
        + "\n".join(f"  {code:>3}  {text}" for code, text in EXIT_CODES.items()),
        formatter_class=_HelpFormatter,
        argument_default=argparse.SUPPRESS if suppress_defaults else None,
    )
    for f in OPTIONS.values():
        m = f.metadata
        flags = m["flags"] or (option_flag(f.name),)
        text = m["help"] + (" [may change on --resume]" if m["resume"] == "may_change" else "")
        kw: dict[str, Any] = {"dest": f.name, "help": argparse.SUPPRESS if m["hidden"] else text}
        if not suppress_defaults:
            kw["default"] = f.default if f.default is not dataclasses.MISSING else f.default_factory()
        if f.default is False:
            kw["action"] = "store_true"
        elif f.name == "surgery_opts":
            kw.update(action="append", metavar=m["metavar"])
        else:
            kw.update({key: m[key] for key in ("choices", "metavar") if m[key]}, type=OPTION_TYPES[f.name])
        p.add_argument(*flags, **kw)

    p.add_argument("--recipe", dest="recipe", metavar="NAME", default=argparse.SUPPRESS,
                   help=f"start from a named recipe's options ({', '.join(recipe_names())}, or a JSON file of "
                   "TrainArgs options; see fastpals/configs/recipes/); options given on the command line override "
                   "it")  # fmt: skip
    return p


def _fmt(name: str) -> str:
    return (OPTIONS[name].metadata["flags"] or (option_flag(name),))[0]


def parse_args(argv: list[str] | None = None) -> TrainArgs:
    """:class:`TrainArgs` from a command line; with ``--resume`` the options saved in ``<out>`` fill in."""
    given = vars(build_parser(suppress_defaults=True).parse_args(argv))
    recipe = given.pop("recipe", None)
    if recipe is not None:
        if given.get("resume"):
            raise ConfigError(
                "--recipe starts a new run; --resume takes the saved run's options: drop --recipe"
            )
        return TrainArgs(**{**load_recipe(recipe), **given})
    if not given.get("resume"):
        return TrainArgs(**{k: v for k, v in vars(build_parser().parse_args(argv)).items() if k != "recipe"})
    out = Path(given.get("out", TrainArgs.__dataclass_fields__["out"].default))
    saved_path = out / "train_args.json"
    if not saved_path.is_file():
        raise ConfigError(
            f"--resume: {saved_path} does not exist, so --out {out} holds no run to resume: check --out, or start "
            f"a new run without --resume"
        )
    fix = ": restore it (the run's checkpoint keeps the options too) or start a new run"
    saved = read_json_object(saved_path, "--resume: ", "must hold a JSON object of options", fix)
    for name, value in saved.items():
        want = type_problem(OPTIONS[name], value) if name in OPTIONS else None
        if want is not None:
            raise ConfigError(
                f"--resume: {saved_path}: {name} = {json.dumps(value)} must be {want}: fix that entry (the run was "
                f"started with the option {_fmt(name)})"
            )
    match = set(resume_fields("match"))
    differ = [k for k in given if k in match and k in saved and given[k] != saved[k]]
    if differ:
        detail = ", ".join(f"{_fmt(k)} (saved {saved[k]!r}, now {given[k]!r})" for k in differ)
        raise ConfigError(
            f"--resume with different options: {detail}; leave them out (the saved ones are used) or start a new "
            f"run in another --out"
        )
    options = {k: v for k, v in saved.items() if k in OPTIONS and k not in PER_INVOCATION}
    return TrainArgs(**{**options, **given})


def keep_freed_memory() -> bool:
    """glibc ``malloc`` tuning: with its defaults a CPU step's large blocks are mapped fresh and unmapped on
    free, so each update pays page faults again. Raises the mmap threshold (1 GiB, else the 32 MiB older glibc
    takes) and stops trimming; True when every setting was taken, False without glibc or where it refused
    one."""
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return False
    try:
        mallopt = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").mallopt
    except OSError:
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    m_trim_threshold, m_top_pad, m_mmap_threshold = -1, -2, -3  # glibc malloc.h
    mmap_ok = mallopt(m_mmap_threshold, 1 << 30) == 1 or mallopt(m_mmap_threshold, 32 << 20) == 1
    return mmap_ok and mallopt(m_trim_threshold, 2**31 - 1) == 1 and mallopt(m_top_pad, 64 << 20) == 1


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``train.py`` and ``fastpals train``; returns the exit status (:data:`EXIT_CODES`)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    debug = "--debug" in argv
    trainer = None
    ctrl_c = SetupCtrlC().install() if threading.current_thread() is threading.main_thread() else SetupCtrlC()
    try:
        args = parse_args(argv)
        keep_freed_memory()  # reuse freed host memory: fewer page faults per update
        trainer = Trainer(args)
        ctrl_c.check()
        trainer.run()
    except ConfigError as err:
        _report(f"{PROG}: error: {err}", debug)
        return 2
    except NonFiniteLossError as err:
        _report(f"{PROG}: {err}", debug)
        return 3
    except OutputError as err:
        _report(f"{PROG}: error: {err}", debug)
        return 4
    except TrainingInterrupted as err:
        _report(f"{PROG}: {err}", debug and err.at_once, hint=False)
        return 128 + err.signum
    except KeyboardInterrupt:  # before the trainer's own handler (the set-up) or after it (the outputs)
        phase = trainer.phase if trainer is not None else "set-up"
        what = (
            "nothing was trained"
            if phase == "set-up"
            else "training had finished; the outputs may be partial"
        )
        _report(f"{PROG}: interrupted by Ctrl-C during the {phase}: {what}", debug, hint=False)
        return 130
    finally:
        ctrl_c.restore()
    return 0


def _report(line: str, debug: bool, hint: bool = True) -> None:
    if debug:
        traceback.print_exc()
    elif hint:
        line += " (--debug shows the traceback)"
    print(line, file=sys.stderr)

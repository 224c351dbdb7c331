"""The step profiler's command line: `python -m benchmarks.step_profile SUB-COMMAND [options]`, one sub-command per
module of this package; `--help` lists them, `SUB-COMMAND --help` gives one's options and what it writes."""

from __future__ import annotations

import argparse
import sys

from benchmarks.step_profile import common, composition, cost, host, layers, lora, overlap, roofline

# sub-command: its module (add_arguments, run) and what it measures; each writes the result file it wrote as a
# script of its own before they were merged (in brackets), so that earlier results stay comparable
SUBCOMMANDS = {
    "cost": (cost, "one engine step's time by composition: decodes at a context, prompt chunks [step_cost]"),
    "composition": (composition, "closed-loop A/B of scheduler settings in one engine [step_composition]"),
    "overlap": (overlap, "host time per step and how much async scheduling hides [host_overlap]"),
    "host": (host, "per-token host overhead of streamed serving: engine loop, server, client [host_overhead]"),
    "roofline": (roofline, "machine peaks, a decode step's FLOPs and bytes, its parts jitted alone [roofline]"),
    "lora": (lora, "a decode step with LoRA adapters (0, 1, 4 distinct) against the engine without LoRA [lora_step]"),
    "layers": (layers, "a CPU decode step's forward, XLA layers against the decode layers [decode_step_profile]"),
}


def parser() -> tuple[argparse.ArgumentParser, dict[str, argparse.ArgumentParser]]:
    """The top-level parser and each sub-command's."""
    ap = argparse.ArgumentParser(
        prog="python -m benchmarks.step_profile",
        description="Where an engine step's time goes. Each sub-command writes benchmarks/results/<date>-<name>.json, "
        "the name in brackets below.",
    )
    sub = ap.add_subparsers(title="sub-commands", metavar="SUB-COMMAND", required=True)
    subparsers = {}
    for name, (module, summary) in SUBCOMMANDS.items():
        p = sub.add_parser(
            name, help=summary, description=module.__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
        )
        module.add_arguments(p)
        p.set_defaults(subcommand=name)
        subparsers[name] = p
    return ap, subparsers


def main(argv: list[str] | None = None) -> int:
    ap, subparsers = parser()
    a = ap.parse_args(argv)
    name = vars(a).pop("subcommand")
    try:
        return SUBCOMMANDS[name][0].run(a)
    except common.OptionError as e:
        subparsers[name].error(str(e))


if __name__ == "__main__":
    sys.exit(main())

"""``tangram patch-dataset IN OUT``: make a dataset's test commands elastic."""
from __future__ import annotations

import argparse
import json
import os
import sys

HELP = """\
Rewrite the test commands of a SWE-style dataset (JSONL, JSON list, Parquet)
so every pytest run takes its worker count at run time (pytest -n
${parallel_num}, pytest-xdist) and Django's runtests.py takes --parallel
${parallel_num}. Other runners are left untouched and reported.

Fields added (never replacing existing ones): <field>_unpatched with the
original value, and tangram_install = "pip install pytest-xdist" where a
pytest run got -n and nothing shows pytest-xdist is installed (the environment
should run it first; --install-step puts it into the script instead).
"""


def register(sub: argparse._SubParsersAction) -> None:
    from datasets_patch.fields import DEFAULT_FIELDS

    p = sub.add_parser("patch-dataset", help="make dataset test commands use ${parallel_num} cores",
                       description=HELP, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("input", metavar="IN", help="dataset file: .jsonl, .json or .parquet")
    p.add_argument("output", metavar="OUT", nargs="?",
                   help="where to write the patched dataset (format from its extension, else IN's)")
    p.add_argument("--field", action="append", dest="fields", metavar="NAME",
                   help="field holding a test command or eval script; repeatable; dotted paths "
                        f"(extra_info.test_cmd) allowed (default: {', '.join(DEFAULT_FIELDS)})")
    p.add_argument("--dry-run", action="store_true", help="only print the summary; write nothing")
    p.add_argument("--keep-explicit", action="store_true",
                   help="keep an explicit worker count (-n 4, --parallel 2) instead of replacing it")
    p.add_argument("--install-step", action="store_true",
                   help="put 'python -m pip install -q pytest-xdist || true' into the script "
                        "instead of adding the tangram_install field")
    p.add_argument("--report", metavar="FILE", help="also write the report as JSON to FILE")
    p.add_argument("--examples", type=int, default=3, metavar="N", help="examples per outcome (default 3)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from datasets_patch.fields import DEFAULT_FIELDS, INSTALL_FIELD
    from datasets_patch.io import FORMATS, DatasetError, read_dataset, write_dataset
    from datasets_patch.jsonvalues import display_default
    try:
        from datasets_patch.records import patch_record
        from datasets_patch.report import Report
    except ImportError as exc:  # bashlex comes with the [datasets] extra
        print(f"tangram patch-dataset: {exc}; pip install 'arl-tangram[datasets]'", file=sys.stderr)
        return 2

    if not args.dry_run and not args.output:
        print("tangram patch-dataset: OUT is required unless --dry-run", file=sys.stderr)
        return 2
    try:
        ds = read_dataset(args.input)
    except DatasetError as exc:
        print(f"tangram patch-dataset: cannot read input {exc}", file=sys.stderr)
        return 2
    fields = tuple(args.fields) if args.fields else DEFAULT_FIELDS
    report = Report(max_examples=max(0, args.examples))
    for index, record in enumerate(ds.records):
        had_install = INSTALL_FIELD in record
        result = patch_record(record, fields, keep_explicit=args.keep_explicit,
                              install_step=args.install_step)
        report.add(index, record, result, install_added=not had_install and INSTALL_FIELD in record)
    # files first, so a closed stdout (| head) cannot lose them
    status = 0
    if args.report:
        try:
            with open(args.report, "w", encoding="utf-8") as fh:
                json.dump(report.to_dict(), fh, indent=2, ensure_ascii=False, default=display_default)
                fh.write("\n")
        except OSError as exc:
            print(f"tangram patch-dataset: cannot write report {args.report}: {exc}", file=sys.stderr)
            status = 1
    if not args.dry_run:
        # OUT's extension picks the format, unless it is IN's: then IN's actual format
        in_ext, out_ext = (os.path.splitext(p)[1].lower() for p in (args.input, args.output))
        out_fmt = ds.fmt if out_ext == in_ext else FORMATS.get(out_ext, ds.fmt)
        try:
            write_dataset(args.output, ds, out_fmt)
        except DatasetError as exc:
            print(f"tangram patch-dataset: cannot write output {exc}", file=sys.stderr)
            return 1
        except KeyboardInterrupt:  # the write is atomic: say OUT is intact, no traceback
            print(f"tangram patch-dataset: interrupted; {args.output} left as it was", file=sys.stderr)
            return 130
    print(report.format())
    print("dry run: nothing written" if args.dry_run
          else f"wrote {len(ds.records)} records to {args.output}")
    return status

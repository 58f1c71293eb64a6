"""`minivllm exercise list | init | check | status`: rebuild pieces of minivllm (exercises/README.md).

    minivllm exercise list                    every exercise, by chapter, with its hint
    minivllm exercise init 03 [--dir D]       copy chapter 03's skeleton to D/ch03/skeleton.py
    minivllm exercise check 03 [--impl I]     run chapter 03's exercise tests (I: learner, the
                                              default, from D/ch03/; skeleton; reference)
    minivllm exercise status [--dir D]        which exercises your last checks passed

D defaults to ./minivllm-exercises. The skeletons and tests are read from the repository
checkout that minivllm is installed from (`pip install -e .`); see minivllm/exercises/.
"""

from __future__ import annotations

import argparse
import shutil
from pathlib import Path

DEFAULT_DIR = Path("minivllm-exercises")


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("exercise", help="list, start and check the exercises of each chapter")
    commands = parser.add_subparsers(dest="exercise_command", required=True)

    commands.add_parser("list", help="every exercise, by chapter, with its hint").set_defaults(func=list_exercises)

    init = commands.add_parser("init", help="copy a chapter's skeleton into your exercise folder")
    init.add_argument("chapter", help="e.g. 03")
    init.add_argument("--force", action="store_true", help="overwrite your existing copy")
    init.set_defaults(func=init_chapter)

    check = commands.add_parser("check", help="run a chapter's exercise tests against an implementation")
    check.add_argument("chapter", help="e.g. 03")
    check.add_argument("--impl", choices=["learner", "skeleton", "reference"], default="learner",
                       help="learner: your copy (default); skeleton: the untouched skeleton; reference: minivllm's own code")
    check.add_argument("-v", "--verbose", action="store_true", help="show pytest's own output, with tracebacks")
    check.set_defaults(func=check_chapter)

    status = commands.add_parser("status", help="which exercises your last checks passed")
    status.set_defaults(func=show_status)

    for command in (init, check, status):
        command.add_argument("--dir", type=Path, default=DEFAULT_DIR, help=f"your exercise folder (default: ./{DEFAULT_DIR})")


def list_exercises(args: argparse.Namespace) -> int:
    from minivllm.exercises import exercises_root
    from minivllm.exercises.markers import exercises_by_chapter

    for chapter, exercises in exercises_by_chapter(exercises_root()).items():
        print(f"chapter {chapter}")
        width = max(len(e.id) for e in exercises)
        for e in exercises:
            print(f"  {e.id:<{width}}  {e.qualname} in {e.file.as_posix()}")
            print(f"  {'':<{width}}  hint: {e.hint}")
    return 0


def init_chapter(args: argparse.Namespace) -> int:
    from minivllm.exercises import exercises_root
    from minivllm.exercises.generate import skeleton_path
    from minivllm.exercises.markers import normalize_chapter

    chapter = normalize_chapter(args.chapter)
    source = skeleton_path(exercises_root(), chapter)
    if not source.exists():
        raise FileNotFoundError(f"chapter {chapter} has no skeleton ({source}); `minivllm exercise list` shows the chapters")
    target = learner_file(args.dir, chapter)
    if target.exists() and not args.force:
        raise ValueError(f"{target} already exists and may hold your work; pass --force to start over")
    target.parent.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(source, target)
    print(f"wrote {target}: replace each `raise NotImplementedError(...)`, then `minivllm exercise check {chapter}`")
    return 0


def check_chapter(args: argparse.Namespace) -> int:
    from minivllm.exercises import exercises_root, progress
    from minivllm.exercises.generate import skeleton_path
    from minivllm.exercises.markers import normalize_chapter
    from minivllm.exercises.runner import chapter_exercises, format_report, run_check

    chapter = normalize_chapter(args.chapter)
    chapter_exercises(chapter)  # an unknown chapter is an error before anything else
    impl_file = None
    if args.impl == "skeleton":
        impl_file = skeleton_path(exercises_root(), chapter)
    elif args.impl == "learner":
        impl_file = learner_file(args.dir, chapter)
        if not impl_file.exists():
            raise FileNotFoundError(f"{impl_file} does not exist; start with `minivllm exercise init {chapter}`")
    result = run_check(chapter, args.impl, impl_file, verbose=args.verbose)
    print(format_report(result))
    if args.impl == "learner":
        progress.record(args.dir, result)
    return 0 if result.ok else 1


def show_status(args: argparse.Namespace) -> int:
    from minivllm.exercises import exercises_root, progress
    from minivllm.exercises.markers import exercises_by_chapter

    recorded = progress.load(args.dir)
    for chapter, exercises in exercises_by_chapter(exercises_root()).items():
        if not learner_file(args.dir, chapter).exists():
            print(f"chapter {chapter}: not started (minivllm exercise init {chapter})")
            continue
        entry = recorded.get(chapter, {"checked_at": None, "exercises": {}})
        statuses = {e.id: entry["exercises"].get(e.id, "-") for e in exercises}
        num_passed = sum(s == "PASS" for s in statuses.values())
        checked = f"last checked {entry['checked_at']}" if entry["checked_at"] else "not checked yet"
        print(f"chapter {chapter}: {num_passed}/{len(exercises)} passed ({checked})")
        for e in exercises:
            print(f"  {statuses[e.id]:<7} {e.id}")
    return 0


def learner_file(folder: Path, chapter: str) -> Path:
    return folder / f"ch{chapter}" / "skeleton.py"

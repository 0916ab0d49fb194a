"""Programs that run under torchrun and check ``ulysses`` on a real process group
(docs/CONTRACT.md §5), as ``ulysses.dist_tests`` from a checkout and installed alike.

    python -m torch.distributed.run --standalone --nproc-per-node P -m ulysses.dist_tests.harness
    python -m ulysses.dist_tests.validate --world-sizes 2 4 6 8        # every P, one table

Modules:
    harness        the runner: suites of cases, bitwise checks, JSON summary
    validate       launches the harness for each world size and prints one table
                   (console script ``ulysses-validate``)
    cases          the ``smooth_k`` suite's cases: case ids, used kinds, input data
    checks         ``CaseRun`` (shared bookkeeping), ulp/bitwise comparisons, the ``smooth_k``
                   run of one case
    faults         planted library faults (``--fault``), a table of ``ulysses._hooks.Hooks``
    rank_faults    faulty, disagreeing or drifting ranks: every rank ends with one clear
                   error, the same on every rank, quickly (a skipped call: the watchdog)
    compile_check  torch.compile / CUDA graph vs eager
    _dist          the one process-group setup: backend, device, timeouts, watchdog, teardown

Adding a suite. A suite is an entry of ``harness.SUITES``:

    SUITES["lowp"] = Suite(
        description="one line for --help",
        cases=cases_lowp.select_cases,   # (*, large: bool, sweep: bool) -> sequence of cases
        run=checks_lowp.run_case,        # (ctx: _dist.Context, case, seed: int) -> CaseRun
        help=cases_lowp.__doc__,         # what the case ids mean, printed by --help
    )

- A case is any object with a unique, stable ``id`` str (the id seeds the case's data: build
  inputs with ``ulysses.testing.make_k_full(..., seed=cases.case_seed(case, seed))``).
  ``cases.resolve_used`` and ``cases.USED_KINDS`` give the shared used_sequence kinds.
- ``run`` returns a ``checks.CaseRun(ctx, case.id)`` after running every step through it:
  ``run.local(name, fn)`` for a step without collectives, ``run.collective(name, fn)`` for a
  step that holds collectives (all ranks run it or all skip it after an error on any rank),
  ``run.check(name, diff)`` for each comparison, where ``diff`` is None when it passed or a
  message (``ulysses.reference.bitwise_diff``, ``checks.ulp_diff``). The runner all-reduces
  the case's failure flag, prints the status line and adds the counts to the summary.
- ``ctx`` gives ``rank``, ``world_size``, ``device`` (the library's tensors), ``backend``,
  ``any_rank(flag)``, ``all_gather_bytes(tensor)`` and ``gather_json(obj)``; the process group
  is the default (world) group.
"""

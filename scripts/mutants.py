"""``make mutants``: do the tests catch the bugs that matter? (issue 39 item 5)

Plants each bug of a fixed list (:data:`MUTANTS`) on its own, in a scratch copy of the working
tree, runs the tests that should catch it, and prints a table of which were caught. Exits 1 if
any mutant survived (or could not be judged), so a test change that stops catching one fails
here. The real tree is never written to.

Each mutant replaces one exact piece of source text (it must occur exactly once, so a refactor
that moves the code makes the mutant "stale" instead of silently testing nothing). Before the
mutants, the union of their tests runs once unmutated in the scratch copy: a test that fails
there would make every mutant look caught. A mutant is caught when its tests fail or error
(a hang past ``--timeout`` counts as caught: a user would notice it too).

Not part of ``make test``: about 30 minutes on two busy CPU cores (a 16-minute baseline, then
about 14 minutes of mutants; ``--jobs`` runs mutants side by side where there are cores). The
list, what each bug would do to a user and the last score are in docs/testing.md.

    python scripts/mutants.py                 # every mutant
    python scripts/mutants.py --only tenant-salt-ignores-tenant,mac-skips-header
    python scripts/mutants.py --list          # the list, nothing run
    python scripts/mutants.py --jobs 4        # four scratch copies at once
    python scripts/mutants.py --rev HEAD      # the last commit, not the working tree
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from queue import Queue

REPO = Path(__file__).resolve().parent.parent


@dataclass(frozen=True)
class Mutant:
    """One planted bug: ``old`` (exactly once in ``path``) becomes ``new``."""

    id: str
    area: str
    path: str
    old: str
    new: str
    tests: tuple[str, ...]  # pytest node ids or files, relative to the repository
    why: str  # what a user would notice
    moved: str = ""  # where the code goes in a move still in flight

    def where(self, root: Path) -> Path:
        """The file to change under ``root``: ``path``, or ``moved`` once the code is there."""
        if self.moved:
            target = root / self.moved
            if target.is_file() and self.old in target.read_text():
                return target
        return root / self.path


U = "tests/unit/"
MUTANTS: tuple[Mutant, ...] = (
    # -- hash chain and salts ------------------------------------------------------------------
    Mutant(
        "chain-root-ignores-salt",
        "hash chain, salts",
        "libs/common/hashchain.py",
        "    h.update(salt)\n    return h.digest()",
        "    return h.digest()",
        (U + "test_known_answers.py", U + "test_hashchain.py"),
        "two tenants' salts of one length name the same blocks: one probes the other's prompts",
    ),
    Mutant(
        "block-hash-forgets-parent",
        "hash chain, salts",
        "libs/common/hashchain.py",
        "    h = hashlib.sha256(parent)\n",
        "    h = hashlib.sha256()\n",
        (U + "test_known_answers.py", U + "test_hashchain.py"),
        "a block's name no longer commits to its prefix: another prompt's KV is reused",
    ),
    Mutant(
        "tenant-salt-ignores-tenant",
        "hash chain, salts",
        "libs/common/hashchain.py",
        "_SALT_DOMAIN + tenant.encode()",
        "_SALT_DOMAIN",
        (U + "test_known_answers.py",),
        "every tenant shares one cache namespace (cache-timing probes across tenants)",
    ),
    # -- MAC and frames --------------------------------------------------------------------------
    Mutant(
        "mac-skips-header",
        "MAC and frames",
        "libs/engine/kv/transfer.py",
        'm = hmac.new(key, replace(header, mac="").to_json(), hashlib.sha256)',
        'm = hmac.new(key, b"", hashlib.sha256)',
        (U + "test_kv_tamper.py", U + "test_known_answers.py"),
        "relabelled block names in a frame's header are imported as the wrong prefix",
    ),
    Mutant(
        "mac-compare-skipped",
        "MAC and frames",
        "libs/engine/kv/transfer.py",
        "    if not hmac.compare_digest(given, frame_mac(key, header, payload).encode()):",
        "    if False:",
        (U + "test_kv_tamper.py",),
        "forged or altered KV is imported into a request's attention",
    ),
    Mutant(
        "frame-payload-length-unchecked",
        "MAC and frames",
        "libs/engine/kv/transfer.py",
        "    if len(payload) != header.num_blocks * header.bytes_per_block:\n        raise",
        "    if False:\n        raise",
        (U + "test_kv_tamper.py", U + "test_engine_load.py"),
        "a truncated frame is read past its end into the next block",
    ),
    # -- EC and shard checks ---------------------------------------------------------------------
    Mutant(
        "shard-crc-unchecked",
        "EC and shard checks",
        "services/kvstore/ec.py",
        "    if magic != SHARD_MAGIC or crc32(shard, _HEAD.size) != crc:",
        "    if magic != SHARD_MAGIC:",
        (U + "test_kv_tamper.py", U + "test_kvstore_io.py"),
        "a flipped bit on disk is decoded into the block instead of being rebuilt from parity",
    ),
    Mutant(
        "block-sha256-unchecked",
        "EC and shard checks",
        "services/kvstore/shards.py",
        "            if joined is not None and hashlib.sha256(joined).hexdigest() == checksum:",
        "            if joined is not None:",
        (U + "test_kv_tamper.py", U + "test_kvstore_io.py"),
        "a kvstore read returns bytes that are not the block that was written",
    ),
    # -- scheduler accounting ------------------------------------------------------------------
    Mutant(
        "scheduler-block-count-floor",
        "scheduler accounting",
        "libs/engine/scheduler.py",
        "math.ceil((req.num_computed + n) / self.bm.block_size)",
        "(req.num_computed + n) // self.bm.block_size",
        (U + "test_scheduler.py",),
        "a request writes KV past its last block (into another request's)",
    ),
    Mutant(
        "block-freed-while-shared",
        "scheduler accounting",
        "libs/engine/kv/block_manager.py",
        "            if self._refs[b] == 0:\n                self._free[b] = None",
        "            if self._refs[b] <= 1:\n                self._free[b] = None",
        (U + "test_block_manager.py",),
        "a prefix block two requests share is evicted under the one still reading it",
    ),
    Mutant(
        "max-tokens-plus-one",
        "scheduler accounting",
        "libs/engine/scheduler.py",
        "            req.num_output_tokens >= req.params.max_tokens",
        "            req.num_output_tokens > req.params.max_tokens",
        (U + "test_scheduler.py", U + "test_engine.py"),
        "every answer is one token longer than max_tokens",
    ),
    # -- sampler rules -------------------------------------------------------------------------
    Mutant(
        "top-p-drops-boundary-token",
        "sampler rules",
        "libs/engine/sampler.py",
        "        before = probs.cumsum(-1) - probs\n",
        "        before = probs.cumsum(-1)\n",
        (U + "test_sampler.py",),
        "top_p cuts the token that crosses the threshold: 0.9 samples from less than 0.9",
    ),
    Mutant(
        "repetition-penalty-inverted",
        "sampler rules",
        "libs/engine/sampler.py",
        "torch.where(x > 0, x / rep, x * rep)",
        "torch.where(x > 0, x * rep, x / rep)",
        (U + "test_sampler.py",),
        "repetition_penalty makes repeats more likely",
    ),
    Mutant(
        "min-tokens-one-short",
        "sampler rules",
        "libs/engine/sampler.py",
        "        if num_generated[i] < p.min_tokens:",
        "        if num_generated[i] + 1 < p.min_tokens:",
        (U + "test_sampler.py", U + "test_engine.py"),
        "an answer can stop one token before min_tokens",
    ),
    # -- grammar masks -------------------------------------------------------------------------
    Mutant(
        "grammar-mask-not-applied",
        "grammar masks",
        "libs/engine/grammar.py",
        "    rows, bitmask = masks\n",
        "    rows, bitmask = masks\n    return\n",
        (U + "test_grammar.py",),
        "json_schema / response_format answers are not JSON",
    ),
    Mutant(
        "grammar-never-advances",
        "grammar masks",
        "libs/engine/grammar.py",
        "        if m is not None and not m.is_terminated() and not m.accept_token(int(token)):",
        "        if False:",
        (U + "test_grammar.py",),
        "a constrained answer repeats its first allowed token class forever",
    ),
    # -- tenant from the key -------------------------------------------------------------------
    Mutant(
        "tenant-from-request",
        "tenant from the key",
        "services/entrypoint/callers.py",
        "                out.tenant = tenant\n",
        "                out.tenant = request.tenant or tenant\n",
        (
            U + "test_entrypoint_handlers.py::"
            "test_generate_needs_a_key_and_the_key_decides_the_tenant",
        ),
        "an API key's caller names another tenant in the request and reads its cache",
    ),
    Mutant(
        "tenant-is-the-key",
        "tenant from the key",
        "libs/common/auth.py",
        "                found = tenant\n",
        "                found = key\n",
        (U + "test_recipe.py::test_auth_keys_and_tenants", U + "test_entrypoint_callers.py"),
        "usage, limits and cache namespaces follow the key instead of its tenant",
    ),
    # -- routing -------------------------------------------------------------------------------
    Mutant(
        "bucket-boundary-off-by-one",
        "routing",
        "libs/routing/buckets.py",
        "    return bisect.bisect_right(bounds, prompt_tokens)",
        "    return bisect.bisect_left(bounds, prompt_tokens)",
        (U + "test_balancer_policy.py", U + "test_balancer_routing.py"),
        "a 16,384-token prompt waits behind short prompts (the < 16K bucket)",
    ),
    Mutant(
        "decode-most-loaded",
        "routing",
        "libs/routing/policy.py",
        "            d = min(dec, key=lambda e: self._decode_key(e, request_id))",
        "            d = max(dec, key=lambda e: self._decode_key(e, request_id))",
        (U + "test_balancer_policy.py", U + "test_balancer_routing.py"),
        "decode goes to the fullest instance: slow streams and preemptions while others idle",
    ),
    Mutant(
        "excluded-instance-routed",
        "routing",
        "libs/routing/policy.py",
        "            if inst.draining or inst.instance_id in excluded or not _serves(inst, model):",
        "            if inst.draining or not _serves(inst, model):",
        (U + "test_balancer_policy.py", U + "test_balancer_routing.py"),
        "a retry goes back to the instance that just failed",
    ),
    Mutant(
        "cache-locality-ignored",
        "routing",
        "libs/routing/policy.py",
        "        runs = {id(e): e.instance.resident_run(hashes) for e in cands}",
        "        runs = {id(e): 0 for e in cands}",
        (U + "test_balancer_policy.py", U + "test_balancer_routing.py"),
        "a follow-up turn recomputes its prefix on an instance that does not hold it",
    ),
    Mutant(
        "moe-weights-from-biased-scores",
        "routing (MoE router)",
        "libs/engine/model/layers.py",
        "            weights = scores.gather(1, idx)",
        "            weights = choice.gather(1, idx)",
        (U + "test_parity_transformers.py", U + "test_layers.py"),
        "DeepSeek-V3's experts are mixed with the load-balancing bias in their weights",
        moved="libs/engine/model/moe.py",  # the MoE split out of layers.py, under way
    ),
    # -- admission -----------------------------------------------------------------------------
    Mutant(
        "tenant-weights-ignored",
        "admission",
        "libs/gateway/admission.py",
        "        return self.weights.get(tenant, 1.0)",
        "        return 1.0",
        (U + "test_admission.py", U + "test_prefill_fairness.py"),
        "a tenant given twice the share gets the same as everyone, at admission and in prefill",
    ),
    Mutant(
        "engine-promises-ignored",
        "admission",
        "libs/gateway/capacity.py",
        "        return load.free_kv_blocks - load.promised_kv_blocks - mine",
        "        return load.free_kv_blocks - mine",
        (U + "test_admission_held.py",),
        "requests are admitted into KV the engine's running requests will grow into: preemptions",
    ),
    Mutant(
        "queue-one-over-cap",
        "admission",
        "libs/gateway/admission.py",
        "        if self._waiting >= self.max_waiting:\n            victim",
        "        if self._waiting > self.max_waiting:\n            victim",
        (U + "test_admission.py",),
        "the queue holds one request more than --max-waiting before 429",
    ),
    # -- API shapes ----------------------------------------------------------------------------
    Mutant(
        "completion-without-created-model",
        "API shapes",
        "services/recipe/completions.py",
        '        "created": created,\n        "model": model,\n'
        '        "system_fingerprint": None,\n        "choices": [j.choice() for j in jobs],',
        '        "system_fingerprint": None,\n        "choices": [j.choice() for j in jobs],',
        (U + "test_recipe_completions.py",),
        "/v1/completions answers lack created and model (typed clients refuse them)",
    ),
    Mutant(
        "max-completion-tokens-ignored",
        "API shapes",
        "services/recipe/fields.py",
        '    "chat_completions": ("max_completion_tokens", "max_tokens"),\n',
        "",
        (U + "test_recipe_fields.py",),
        "max_completion_tokens is ignored: answers run to the 4,096-token default",
    ),
    Mutant(
        "chat-message-without-refusal",
        "API shapes",
        "services/recipe/answer.py",
        '                choice["message"].setdefault("refusal", None)',
        "                pass",
        (U + "test_recipe.py", U + "test_sdk_strict.py"),
        "a chat message lacks refusal, which OpenAI's spec requires (null allowed)",
    ),
    Mutant(
        "responses-usage-without-cache-write",
        "API shapes",
        "services/recipe/answer.py",
        '            details.setdefault("cache_write_tokens", 0)',
        "            pass",
        (U + "test_sdk_strict.py",),
        "the openai SDK's strict mode refuses every Responses answer",
    ),
    Mutant(
        "anthropic-errors-in-openai-shape",
        "API shapes",
        "services/recipe/api.py",
        "        if self.anthropic:\n            kind = _ANTHROPIC_TYPES",
        "        if False:\n            kind = _ANTHROPIC_TYPES",
        (U + "test_recipe.py",),
        "Anthropic clients get OpenAI-shaped errors (their error type and message are lost)",
    ),
    # -- kvstore retention ---------------------------------------------------------------------
    Mutant(
        "ttl-ignores-traffic-class",
        "kvstore retention",
        "libs/kvstore/policy.py",
        "        return self.ttls.get(traffic_class, self.ttls[self.default_class])",
        "        return self.ttls[self.default_class]",
        (U + "test_kvstore_policy.py",),
        "agent traffic's blocks are kept 7 days instead of 3 (or chat's dropped early)",
    ),
    # -- cost model ----------------------------------------------------------------------------
    Mutant(
        "cost-model-drops-attention",
        "cost model",
        "libs/engine/cost_model.py",
        "            + self.attn_flops_per_pair * pairs\n",
        "\n",
        (U + "test_cost_model_flops.py",),
        "long prompts' steps overrun their time budget; published MFU is wrong",
    ),
    # -- retry exactness -----------------------------------------------------------------------
    Mutant(
        "unseeded-sampling-resumed",
        "retry exactness",
        "libs/gateway/retry.py",
        "    return temperature == 0 or seed is not None",
        "    return True",
        (U + "test_entrypoint_retry.py",),
        "after a failover an unseeded answer continues with draws the client never asked for",
    ),
    Mutant(
        "resume-without-sent-tokens",
        "retry exactness",
        "libs/gateway/retry.py",
        "        return self.prompt + tuple(self.sent)",
        "        return self.prompt",
        (U + "test_entrypoint_retry.py", U + "test_resume_prior_outputs.py"),
        "after a failover the answer starts again: the client sees its first tokens twice",
    ),
    # -- speculative decoding ------------------------------------------------------------------
    Mutant(
        "rejected-draft-resampled",
        "sampler rules (speculative)",
        "libs/engine/speculative.py",
        "        residual[d] = 0.0\n",
        "",
        (U + "test_speculative.py::test_rejection_sampling_gives_the_targets_distribution",),
        "speculative decoding samples from a different distribution than plain decoding",
        moved="libs/engine/speculative/verify.py",  # the package split under way
    ),
)


# -- running -------------------------------------------------------------------------------------
@dataclass
class Outcome:
    mutant: Mutant
    result: str  # caught, survived, stale, error
    seconds: float
    detail: str  # the first failing test, or why it could not be judged


def source_files(root: Path) -> list[str]:
    """The working tree's files as git sees them: tracked and untracked, not ignored."""
    out = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=root,
        check=True,
        capture_output=True,
    ).stdout.decode()
    return sorted({p for p in out.split("\0") if p and (root / p).is_file()})


def scratch_copy(files: Sequence[str], rev: str = "") -> Path:
    """A copy of the working tree's ``files``, or of commit ``rev``'s tree."""
    dest = Path(tempfile.mkdtemp(prefix="deepserve-mutants-"))
    if rev:
        archive = subprocess.run(
            ["git", "archive", rev], cwd=REPO, check=True, capture_output=True
        ).stdout
        subprocess.run(["tar", "-x", "-C", str(dest)], input=archive, check=True)
        return dest
    for rel in files:
        target = dest / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(REPO / rel, target)
    return dest


def env_for(scratch: Path) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(scratch)  # before the editable install's finder
    # No .pyc: a mutant and its undo may have one size and one mtime second.
    env["PYTHONDONTWRITEBYTECODE"] = "1"
    return env


def check_scratch(scratch: Path) -> None:
    """The scratch copy is what Python imports (not the editable install's tree)."""
    probe = "import libs, services, deepserve; print(libs.__file__, services.__file__)"
    out = subprocess.run(
        [sys.executable, "-c", probe],
        cwd=scratch,
        env=env_for(scratch),
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    if any(not Path(p).resolve().is_relative_to(scratch.resolve()) for p in out.split()):
        raise SystemExit(f"the scratch copy is not what Python imports: {out.strip()}")


def pytest(scratch: Path, tests: Sequence[str], timeout: float) -> tuple[int, str]:
    cmd = [sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", *tests]
    try:
        done = subprocess.run(
            cmd,
            cwd=scratch,
            env=env_for(scratch),
            capture_output=True,
            text=True,
            timeout=timeout,
        )
    except subprocess.TimeoutExpired:
        return -1, f"timed out after {timeout:.0f} s"
    return done.returncode, done.stdout + done.stderr


def first_failure(output: str) -> str:
    m = re.search(r"^(?:FAILED|ERROR) (\S+)", output, re.M)
    return m.group(1) if m else ""


def run_mutant(m: Mutant, scratch: Path, timeout: float) -> Outcome:
    target = m.where(scratch)
    if not target.is_file():
        return Outcome(m, "stale", 0.0, f"{m.path}: no such file")
    original = target.read_text()
    if original.count(m.old) != 1:
        found = original.count(m.old)
        return Outcome(m, "stale", 0.0, f"{m.path}: the text to change occurs {found} times")
    target.write_text(original.replace(m.old, m.new))
    start = time.monotonic()
    try:
        rc, output = pytest(scratch, m.tests, timeout)
    finally:
        target.write_text(original)
    took = time.monotonic() - start
    if rc == -1:
        return Outcome(m, "caught", took, output)
    if rc in (1, 2):  # tests failed, or failed to import
        return Outcome(m, "caught", took, first_failure(output) or output.strip()[-200:])
    if rc == 0:
        return Outcome(m, "survived", took, "all its tests pass")
    return Outcome(m, "error", took, f"pytest exit {rc}: {output.strip()[-300:]}")


def baseline(scratch: Path, mutants: Sequence[Mutant], timeout: float) -> None:
    tests = list(dict.fromkeys(t for m in mutants for t in m.tests))
    whole = {t for t in tests if "::" not in t}  # a file run whole covers its node ids
    tests = [t for t in tests if t in whole or t.split("::")[0] not in whole]
    print(f"baseline: {len(tests)} test selections, unmutated ...", flush=True)
    start = time.monotonic()
    rc, output = pytest(scratch, tests, timeout * 3)
    if rc != 0:
        print(output[-3000:])
        raise SystemExit(
            f"the unmutated tests fail (exit {rc}, {first_failure(output)}): fix them first"
        )
    print(f"baseline: passed in {time.monotonic() - start:.0f} s", flush=True)


def table(outcomes: Sequence[Outcome]) -> str:
    rows = [("mutant", "area", "result", "s", "caught by / why not")]
    for o in outcomes:
        rows.append(
            (o.mutant.id, o.mutant.area, o.result, f"{o.seconds:.0f}", o.detail.splitlines()[0])
        )
    widths = [max(len(r[i]) for r in rows) for i in range(4)]
    lines = []
    for i, r in enumerate(rows):
        lines.append(
            "  ".join(c.ljust(w) for c, w in zip(r[:4], widths, strict=True)) + "  " + r[4]
        )
        if i == 0:
            lines.append("  ".join("-" * w for w in widths) + "  " + "-" * 20)
    return "\n".join(lines)


def markdown(outcomes: Sequence[Outcome]) -> str:
    """The table docs/testing.md shows (``--markdown``)."""
    rows = ["| mutant | area | what a user would notice | caught by |", "|---|---|---|---|"]
    for o in outcomes:
        by = o.detail.splitlines()[0] if o.result == "caught" else f"**{o.result}**"
        rows.append(f"| `{o.mutant.id}` | {o.mutant.area} | {o.mutant.why} | `{by}` |")
    return "\n".join(rows)


def selected(only: str) -> list[Mutant]:
    if not only:
        return list(MUTANTS)
    want = [x.strip() for x in only.split(",") if x.strip()]
    known = {m.id: m for m in MUTANTS}
    missing = [w for w in want if w not in known]
    if missing:
        raise SystemExit(f"no such mutant: {', '.join(missing)} (--list names them)")
    return [known[w] for w in want]


def scratches(n: int, files: Sequence[str], rev: str) -> Iterator[Path]:
    for _ in range(n):
        yield scratch_copy(files, rev)


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--only", default="", help="comma-separated mutant ids")
    ap.add_argument("--list", action="store_true", help="print the mutants and exit")
    ap.add_argument("--jobs", type=int, default=int(os.environ.get("MUTANTS_JOBS", "1")))
    ap.add_argument("--timeout", type=float, default=600.0, help="seconds per mutant's tests")
    ap.add_argument("--no-baseline", action="store_true", help="skip the unmutated run")
    ap.add_argument("--keep", action="store_true", help="keep the scratch copies")
    ap.add_argument("--rev", default="", help="mutate this commit (default: the working tree)")
    ap.add_argument("--markdown", action="store_true", help="also print docs/testing.md's table")
    args = ap.parse_args(argv)
    mutants = selected(args.only)
    if args.list:
        for m in mutants:
            print(f"{m.id:34} {m.area:28} {m.path}\n{'':34} {m.why}")
        return 0
    files = [] if args.rev else source_files(REPO)
    pool: Queue[Path] = Queue()
    made = list(scratches(max(1, args.jobs), files, args.rev))
    for s in made:
        pool.put(s)
    try:
        check_scratch(made[0])
        if not args.no_baseline:
            baseline(made[0], mutants, args.timeout)

        def one(m: Mutant) -> Outcome:
            scratch = pool.get()
            try:
                out = run_mutant(m, scratch, args.timeout)
            finally:
                pool.put(scratch)
            print(f"{out.result:8} {m.id} ({out.seconds:.0f} s)", flush=True)
            return out

        with ThreadPoolExecutor(max_workers=max(1, args.jobs)) as ex:
            outcomes = list(ex.map(one, mutants))
    finally:
        if not args.keep:
            for s in made:
                shutil.rmtree(s, ignore_errors=True)
    print()
    print(table(outcomes))
    if args.markdown:
        print("\n" + markdown(outcomes))
    caught = sum(o.result == "caught" for o in outcomes)
    print(f"\n{caught} of {len(outcomes)} mutants caught ({100 * caught / len(outcomes):.0f}%)")
    bad = [o for o in outcomes if o.result != "caught"]
    if bad:
        print("not caught: " + ", ".join(f"{o.mutant.id} ({o.result})" for o in bad))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())

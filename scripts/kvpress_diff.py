"""Count, per method and kvpress ratio, the prompt tokens on which veloxquant and the kvpress reference files disagree
(symmetric difference summed over all (layer, KV head)); the test tests/test_kvpress_compare.py asserts that every
such token is a near-tie in kvpress's scores. Usage: python scripts/kvpress_diff.py qfilters,kvzip OUT.json"""
import json, sys
sys.path.insert(0, "tests")
import test_kvpress_compare as t
import veloxquant.evict as evict
out = {}
for m in sys.argv[1].split(","):
    ref = t.load_reference(m)
    for ratio in t.RATIOS:
        theirs = t.reference_kept(ref, t.run_for(ref, ratio))
        ours = evict.kept_indices(m, t.prompt_ids(), ratio, params=ref["params"])
        d = {f"{l},{h}": len(set(ours[l, h]) ^ set(theirs[l, h])) for (l, h) in theirs}
        tot = sum(d.values()); kept = sum(len(v) for v in theirs.values())
        out[f"{m}@{ratio}"] = dict(sym_diff_tokens=tot, kvpress_kept=kept, heads_differing=sum(1 for v in d.values() if v),
                                   ours_kept=sum(len(v) for v in ours.values()))
        print(m, ratio, out[f"{m}@{ratio}"], flush=True)
json.dump(out, open(sys.argv[2], "w"), indent=1)

"""The two sizes of a kvtc cache on the default model: a 2048-token prompt of the evaluation text prefilled into kvtc
caches (standard setting), then per layer the resident bytes while attending (`nbytes`), the bytes of the saved state
(`saved_nbytes`: range-coded codes, bases, fp16 sinks and window) and the size of the `save_prompt_cache` file, next
to the fp16 bytes of the same keys and values. Writes nbs/lowrank_kvtc_sizes.json."""
import json, os, sys, tempfile
import mlx.core as mx
from mlx_lm.models.cache import save_prompt_cache
import veloxquant as vq
from veloxquant.models import load_model, eval_tokens

T = 2048
model, tok = load_model(); ids = eval_tokens(tok, T + 1)
caches = vq.KVCacheBuilder.for_model(model, vq.KVCacheConfig("kvtc"))
mx.eval(model(mx.array(ids[:T])[None], cache=caches)); mx.eval(model(mx.array(ids[T:T + 1])[None], cache=caches))
f = os.path.join(tempfile.mkdtemp(), "kvtc.safetensors"); save_prompt_cache(f, caches)
rows = [dict(layer=i, nbytes=c.nbytes, saved_nbytes=c.saved_nbytes(), fp16_bytes=2 * c.n_elements,
             key_alloc=list(c.k_codec.alloc), value_alloc=list(c.v_codec.alloc)) for i, c in enumerate(caches)]
out = dict(command="python scripts/lowrank_kvtc_sizes.py", tokens=T + 1, file_bytes=os.path.getsize(f), rows=rows)
json.dump(out, open(sys.argv[1] if len(sys.argv) > 1 else "nbs/lowrank_kvtc_sizes.json", "w"), indent=1)
print(json.dumps({k: v for k, v in out.items() if k != "rows"}), sum(r["nbytes"] for r in rows), sum(r["saved_nbytes"] for r in rows), sum(r["fp16_bytes"] for r in rows))

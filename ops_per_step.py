"""One-off (branch engine-generate): aten ops per fast-path step at batch 1 on the CPU, SmolLM2-shaped random target
+ the shipped drafter, float32; kernel-launching ops only. Run on this branch and on main, then diff the outputs."""
import torch, sys, collections
sys.path.insert(0, ".")
from tests.conftest import tiny_drafter
from transformers import AutoConfig, AutoModelForCausalLM
import hf_dflash
from hf_dflash.generate_cli import DEFAULT_DRAFTER
torch.manual_seed(0)
config = AutoConfig.for_model("llama", hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
    num_attention_heads=9, num_key_value_heads=3, vocab_size=49152, max_position_embeddings=8192,
    rope_theta=100000.0, tie_word_embeddings=True, head_dim=64)
target = AutoModelForCausalLM.from_config(config).eval()
drafter = hf_dflash.DFlashDraftModel.from_pretrained(DEFAULT_DRAFTER, dtype=torch.float32).eval()
ids = torch.randint(100, 40000, (int(sys.argv[1]), 64))
kw = dict(attention_mask=torch.ones_like(ids), do_sample=False, pad_token_id=0, assistant_model=drafter, dflash_fast_path=True)
target.generate(ids, max_new_tokens=20, min_new_tokens=20, **kw)
def count(n):
    with torch.profiler.profile() as p:
        out = target.generate(ids, max_new_tokens=n, min_new_tokens=n, return_dict_in_generate=True, **kw)
    ev = p.key_averages()
    return sum(e.count for e in ev if e.key.startswith("aten::")), collections.Counter({e.key: e.count for e in ev if e.key.startswith("aten::")}), sum(len(a) for a in out.acceptance_lengths)
a, ca, sa = count(2); b, cb, sb = count(34)
print("ops per step", (b - a) / (sb - sa), "steps", sb - sa)
diff = {k: (cb[k] - ca[k]) / (sb - sa) for k in cb}
meta = {"aten::as_strided","aten::view","aten::transpose","aten::reshape","aten::resolve_conj","aten::slice","aten::_unsafe_view","aten::t","aten::unsqueeze","aten::select","aten::expand","aten::narrow","aten::linear","aten::matmul","aten::to","aten::_to_copy","aten::empty","aten::empty_strided","aten::empty_like","aten::detach","aten::alias","aten::permute","aten::squeeze","aten::contiguous","aten::lift_fresh","aten::_reshape_alias","aten::split","aten::chunk","aten::unbind","aten::item","aten::_local_scalar_dense","aten::result_type","aten::is_nonzero","aten::flatten","aten::view_as","aten::expand_as","aten::clone"}
for k, v in sorted(diff.items()): print(f"  {k} {v:.1f}") if k not in meta and v else None

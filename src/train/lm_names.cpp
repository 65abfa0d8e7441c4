// A language model's parameters under Hugging Face's names (include/dtrain/train/lm_names.h).
#include "dtrain/train/lm_names.h"

#include <set>

namespace dtrain::train {

namespace {

void add_llama_block(std::map<std::string, std::vector<SourceTensor>>& out, const nn::GptConfig& g,
                     const std::string& ours, const std::string& hf) {
  const int64_t hd = g.width / g.heads, f = g.hidden();
  out[ours + "0.body.0.weight"] = {{hf + "input_layernorm.weight"}};
  out[ours + "1.body.0.weight"] = {{hf + "post_attention_layernorm.weight"}};
  for (const std::string what : {"weight", "bias"}) {
    if (what == "bias" && !g.bias) continue;
    out[ours + "0.body.1.qkv." + what] = {{hf + "self_attn.q_proj." + what, g.heads * hd},
                                          {hf + "self_attn.k_proj." + what, g.kv() * hd},
                                          {hf + "self_attn.v_proj." + what, g.kv() * hd}};
    out[ours + "0.body.1.proj." + what] = {{hf + "self_attn.o_proj." + what}};
    out[ours + "1.body.1." + what] = {{hf + "mlp.gate_proj." + what, f}, {hf + "mlp.up_proj." + what, f}};
    out[ours + "1.body.3." + what] = {{hf + "mlp.down_proj." + what}};
  }
}

void add_gpt2_block(std::map<std::string, std::vector<SourceTensor>>& out, const std::string& ours,
                    const std::string& hf) {
  for (const std::string what : {"weight", "bias"}) {
    const bool matrix = what == "weight";  // Conv1D: (in, out)
    out[ours + "0.body.0." + what] = {{hf + "ln_1." + what}};
    out[ours + "0.body.1.qkv." + what] = {{hf + "attn.c_attn." + what, -1, matrix}};
    out[ours + "0.body.1.proj." + what] = {{hf + "attn.c_proj." + what, -1, matrix}};
    out[ours + "1.body.0." + what] = {{hf + "ln_2." + what}};
    out[ours + "1.body.1." + what] = {{hf + "mlp.c_fc." + what, -1, matrix}};
    out[ours + "1.body.3." + what] = {{hf + "mlp.c_proj." + what, -1, matrix}};
  }
}

}  // namespace

std::map<std::string, std::vector<SourceTensor>> lm_hf_layout(const nn::GptConfig& g) {
  std::map<std::string, std::vector<SourceTensor>> out;
  if (g.llama()) {
    out["wte"] = {{"model.embed_tokens.weight"}};
    if (!g.tied) out["lm_head"] = {{"lm_head.weight"}};
    out["ln_f.weight"] = {{"model.norm.weight"}};
  } else {
    out["wte"] = {{"transformer.wte.weight"}};
    out["wpe"] = {{"transformer.wpe.weight"}};
    out["ln_f.weight"] = {{"transformer.ln_f.weight"}};
    out["ln_f.bias"] = {{"transformer.ln_f.bias"}};
  }
  for (int64_t i = 0; i < g.layers; ++i) {
    const std::string ours = "blocks." + std::to_string(i) + ".";
    if (g.llama())
      add_llama_block(out, g, ours, "model.layers." + std::to_string(i) + ".");
    else
      add_gpt2_block(out, ours, "transformer.h." + std::to_string(i) + ".");
  }
  return out;
}

PretrainedNames lm_pretrained_names(const nn::GptConfig& g, const std::map<std::string, SafetensorsEntry>& files) {
  auto layout = std::make_shared<std::map<std::string, std::vector<SourceTensor>>>(lm_hf_layout(g));
  PretrainedNames n;
  if (files.count("wte")) {  // dtrain's own names (an export with --names dtrain)
    n.scheme = "dtrain";
    n.sources = [](const std::string& p) {
      return nn::is_lora_adapter(p) ? std::vector<SourceTensor>{} : std::vector<SourceTensor>{{p}};
    };
    n.known = [layout](const std::string& t) { return layout->count(t) > 0; };
    return n;
  }
  // GPT-2 checkpoints are found with and without the "transformer." prefix.
  const bool bare = !g.llama() && !files.count("transformer.wte.weight") && files.count("wte.weight");
  auto named = [bare](std::string name) { return bare ? name.substr(std::string("transformer.").size()) : name; };
  auto all = std::make_shared<std::set<std::string>>();
  for (auto& [param, sources] : *layout)
    for (SourceTensor& s : sources) all->insert(s.name = named(s.name));
  n.scheme = g.llama() ? "Hugging Face Llama" : "Hugging Face GPT-2";
  n.sources = [layout](const std::string& p) {
    if (nn::is_lora_adapter(p)) return std::vector<SourceTensor>{};
    const auto it = layout->find(p);
    return it == layout->end() ? std::vector<SourceTensor>{{p}} : it->second;
  };
  const bool gpt2 = !g.llama();
  n.known = [all, gpt2](const std::string& t) {
    // GPT-2's causal masks (attn.bias, attn.masked_bias) are buffers, and its lm_head is the tied wte.
    return all->count(t) > 0 ||
           (gpt2 && (t.ends_with(".attn.bias") || t.ends_with(".attn.masked_bias") || t == "lm_head.weight"));
  };
  return n;
}

}  // namespace dtrain::train

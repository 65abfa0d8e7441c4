#pragma once
// A language model's parameters under other frameworks' names, for `dtrain export` and
// `--init-from`: Hugging Face's LlamaForCausalLM names for the Llama family, GPT-2's for the GPT.
#include <map>
#include <string>
#include <vector>

#include "dtrain/nn/gpt.h"
#include "dtrain/train/import.h"

namespace dtrain::train {

// Every parameter of the whole model of `g` (dtrain's names) and the tensors it is under Hugging
// Face's names, stacked by rows in order:
// - a Llama (g.llama()): model.embed_tokens.weight, model.layers.<i>.{input_layernorm,
//   self_attn.{q,k,v,o}_proj, post_attention_layernorm, mlp.{gate,up,down}_proj}.weight (and
//   biases where the model has them), model.norm.weight, lm_head.weight (untied); the fused q/k/v
//   projection is q_proj, k_proj, v_proj and the fused gate/up projection gate_proj, up_proj;
//   matrices (out, in) as nn.Linear's;
// - the GPT: transformer.wte.weight, transformer.wpe.weight, transformer.h.<i>.{ln_1, attn.c_attn,
//   attn.c_proj, ln_2, mlp.c_fc, mlp.c_proj}.{weight, bias} with the four projections' weights
//   transposed to (in, out) (GPT-2's Conv1D), transformer.ln_f.*; the unembedding is tied.
std::map<std::string, std::vector<SourceTensor>> lm_hf_layout(const nn::GptConfig& g);

// How `files` (list_safetensors) name the parameters of the whole model of `g`: dtrain's names
// when they hold "wte", else Hugging Face's (GPT-2's with or without the "transformer." prefix).
PretrainedNames lm_pretrained_names(const nn::GptConfig& g, const std::map<std::string, SafetensorsEntry>& files);

}  // namespace dtrain::train

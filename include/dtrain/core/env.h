#pragma once
// The one place that declares every DTRAIN_* environment variable, its meaning and default.
#include <string>
#include <vector>

namespace dtrain::env {

struct Knob {
  const char* name;
  const char* default_value;
  const char* meaning;
};
const std::vector<Knob>& knobs();

// Value of a declared knob (the default when unset). Throws if `name` is not declared above.
std::string get(const char* name);
double get_double(const char* name);
long get_long(const char* name);

}  // namespace dtrain::env

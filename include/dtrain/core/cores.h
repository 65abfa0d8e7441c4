#pragma once
// How many processor cores the machine has, and how many this process may run on.

namespace dtrain {

int online_cores();    // cores online on this node (at least 1)
int affinity_cores();  // cores in this process's affinity mask: what a binding launcher gave it (at least 1)

}  // namespace dtrain

// The attention tile kernels in 4-float vectors (portable C++: the fallback on any processor).
#define DT_ATT_LANES 4
#define DT_ATT_NS generic
#define DT_ATT_NAME "generic"
#include "cpu_tiles.h"

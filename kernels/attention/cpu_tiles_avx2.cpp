// The attention tile kernels in 8-float vectors (the only file compiled with AVX2; cpu.cpp calls it after checking the processor).
#define DT_ATT_LANES 8
#define DT_ATT_NS avx2
#define DT_ATT_NAME "avx2"
#include "cpu_tiles.h"

// The attention tile kernels in 16-float vectors (the only file compiled with AVX512; cpu.cpp calls it after checking the processor).
#define DT_ATT_LANES 16
#define DT_ATT_NS avx512
#define DT_ATT_NAME "avx512"
#include "cpu_tiles.h"

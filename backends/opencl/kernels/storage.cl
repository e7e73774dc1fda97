/* Storage types of the portakern OpenCL kernels, prepended to each of them (program.kernel_source): half or
 * float in memory, float32 in arithmetic. IN_HALF: inputs are half (tin, read with LD); OUT_HALF: outputs are
 * half (tout, written with ST, rounded to nearest even). Both defines are set by the op's host code. */

#if IN_HALF
typedef half tin;
#define LD(p, i) vload_half((i), (p))
#else
typedef float tin;
#define LD(p, i) ((p)[(i)])
#endif

#if OUT_HALF
typedef half tout;
#define ST(v, p, i) vstore_half_rte((v), (i), (p))
#else
typedef float tout;
#define ST(v, p, i) ((p)[(i)] = (v))
#endif


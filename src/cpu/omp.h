/* OpenMP directives that vanish in a build without OpenMP (where CMake finds
 * none: gcc's -Wunknown-pragmas, part of -Wall, would fail the -Werror build
 * on a bare #pragma omp). EPX_OMP(parallel for ...) is #pragma omp parallel
 * for ... with OpenMP and nothing without; code that only a directive uses
 * (an `if` clause's predicate) goes under #ifdef _OPENMP too. */
#ifndef EPX_CPU_OMP_H
#define EPX_CPU_OMP_H

#ifdef _OPENMP
#define EPX_OMP(...) _Pragma(EPX_OMP_TEXT(omp __VA_ARGS__))
#define EPX_OMP_TEXT(...) #__VA_ARGS__
#else
#define EPX_OMP(...)
#endif

#endif

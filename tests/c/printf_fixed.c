/*
 * Prints numbers as glibc's printf("%.Nf") does, for comparison with our formatter.
 * Reads lines from stdin:
 *     f <hex bits of a 32-bit float>   -> printf("%.4f\n", (float)x)  (promoted to double)
 *     d <hex bits of a double> <N>     -> printf("%.*f\n", N, x)
 */
#include <inttypes.h>
#include <stdio.h>
#include <string.h>

int main(void)
{
    char kind;
    while (scanf(" %c", &kind) == 1) {
        if (kind == 'f') {
            uint32_t bits;
            float x;
            if (scanf("%" SCNx32, &bits) != 1)
                return 1;
            memcpy(&x, &bits, sizeof x);
            printf("%.4f\n", x);
        } else if (kind == 'd') {
            uint64_t bits;
            int prec;
            double x;
            if (scanf("%" SCNx64 " %d", &bits, &prec) != 2)
                return 1;
            memcpy(&x, &bits, sizeof x);
            printf("%.*f\n", prec, x);
        } else {
            return 1;
        }
    }
    return 0;
}

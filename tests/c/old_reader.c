/*
 * The classic history reader, as every pre-header C reader was written:
 *
 *     while (fscanf(f, "%d %d %u", &l, &e, &c) == 3)
 *         if (l >= 0 && in range) use the record;
 *
 * Usage: old_reader FILE N_LAYERS N_EXPERTS
 * Prints every triple the loop scanned ("T l e c"), every record it admitted
 * ("A l e c": 0 <= l <= N_LAYERS and 0 <= e < N_EXPERTS), then
 * "TOTAL <sum of admitted counts> <admitted records>".
 */
#include <stdio.h>
#include <stdlib.h>

int main(int argc, char **argv)
{
    if (argc != 4) {
        fprintf(stderr, "usage: old_reader FILE N_LAYERS N_EXPERTS\n");
        return 2;
    }
    FILE *f = fopen(argv[1], "r");
    if (!f) {
        perror(argv[1]);
        return 1;
    }
    int nl = atoi(argv[2]), ne = atoi(argv[3]);
    int l, e;
    unsigned c;
    long long total = 0;
    long records = 0;
    while (fscanf(f, "%d %d %u", &l, &e, &c) == 3) {
        printf("T %d %d %u\n", l, e, c);
        if (l >= 0 && l <= nl && e >= 0 && e < ne) {
            printf("A %d %d %u\n", l, e, c);
            total += c;
            records++;
        }
    }
    printf("TOTAL %lld %ld\n", total, records);
    fclose(f);
    return 0;
}

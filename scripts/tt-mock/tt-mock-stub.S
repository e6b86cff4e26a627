# The one object every mock kernel and firmware ELF is linked from: an entry point and one word of data,
# enough for tt-metal's loader (segments, _start) and for kernels' relocation section.
    .section .start,"ax",@progbits
    .globl _start
_start:
    lla a0, _start
    ret
    .section .data,"aw",@progbits
    .globl tt_mock_data
tt_mock_data:
    .word 0

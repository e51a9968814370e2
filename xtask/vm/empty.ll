; The empty tc program vm-test measures the datapath against (`llc -march=bpfel`): returns
; TC_ACT_UNSPEC (-1) and touches nothing, so its cost under BPF_PROG_TEST_RUN is the harness's.
define i32 @wgfence_empty(i8* %ctx) section "classifier" {
  ret i32 -1
}
@_license = global [4 x i8] c"GPL\00", section "license"

# Builds the apex extensions that the job's apex paths use (sm_90 only), from apex's own sources.
import os
from setuptools import setup
from torch.utils.cpp_extension import BuildExtension, CppExtension, CUDAExtension

here = os.path.dirname(os.path.abspath(__file__))
os.chdir(os.path.join(here, "apex_src"))
fast = ["-O3", "--use_fast_math"]
half = ["-U__CUDA_NO_HALF_OPERATORS__", "-U__CUDA_NO_HALF_CONVERSIONS__", "--expt-relaxed-constexpr", "--expt-extended-lambda"]
amp = ["amp_C_frontend.cpp"] + [f"{n}.cu" for n in (
    "multi_tensor_sgd_kernel", "multi_tensor_scale_kernel", "multi_tensor_axpby_kernel", "multi_tensor_l2norm_kernel",
    "multi_tensor_l2norm_kernel_mp", "multi_tensor_l2norm_scale_kernel", "multi_tensor_lamb_stage_1",
    "multi_tensor_lamb_stage_2", "multi_tensor_adam", "multi_tensor_adagrad", "multi_tensor_novograd",
    "multi_tensor_lamb", "multi_tensor_lamb_mp", "update_scale_hysteresis")]
setup(
    name="apex_min",
    ext_modules=[
        CppExtension("apex_C", ["csrc/flatten_unflatten.cpp"]),
        CUDAExtension("amp_C", [f"csrc/{s}" for s in amp], extra_compile_args={"cxx": ["-O3"], "nvcc": ["-lineinfo"] + fast}),
        CUDAExtension("fused_layer_norm_cuda", ["csrc/layer_norm_cuda.cpp", "csrc/layer_norm_cuda_kernel.cu"],
                      extra_compile_args={"cxx": ["-O3"], "nvcc": ["-maxrregcount=50"] + fast}),
        CUDAExtension("fused_weight_gradient_mlp_cuda", [
            "csrc/megatron/fused_weight_gradient_dense.cpp", "csrc/megatron/fused_weight_gradient_dense_cuda.cu",
            "csrc/megatron/fused_weight_gradient_dense_16bit_prec_cuda.cu"],
            include_dirs=[os.path.join(here, "apex_src", "csrc")],
            extra_compile_args={"cxx": ["-O3"], "nvcc": ["-O3"] + half + ["--use_fast_math"]}),
    ],
    cmdclass={"build_ext": BuildExtension},
)

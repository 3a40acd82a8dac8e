"""The default config: every config in `configs/` starts from it and overrides it (the recipes
they share are in `rspc_jax/training/recipes.py`)."""

import ml_collections


def get_default_config() -> ml_collections.ConfigDict:
    c = ml_collections.ConfigDict()
    c.seed = 0

    # Model: any name in `rspc_jax.models.names()`; `model` holds constructor overrides.
    c.model_name = "vit_demo"
    c.model = ml_collections.ConfigDict()
    # Start from a released/exported PyTorch checkpoint (.pth, .pth.tar, .safetensors, .npz
    # with official key names) instead of a random init; ignored when the workdir already has
    # a checkpoint to resume from. README: "Start from a released checkpoint".
    c.init_from = ""
    c.init_from_ema = False  # take its EMA weights (state_dict_ema / model_ema)
    c.init_head = "load"  # 'load' | 'reset' (fresh head, e.g. another number of classes)
    c.init_resize = False  # interpolate RVT* PAAS masks / ViT pos_embed to image_size
    # BatchNorm batch statistics over all devices instead of per device (official: per GPU).
    c.bn_cross_device = False
    # Forward-pass dtype; 'bfloat16' keeps float32 params and optimizer state (TPU speed and
    # memory).
    c.compute_dtype = "float32"
    # Execution options of the model that leave its parameters unchanged (so a checkpoint
    # loads either way): recompute each block's activations in the backward pass (memory),
    # and run ViT/DeiT blocks as one scan (compile time).
    c.remat = False
    c.scan_blocks = False
    # 'fsdp' shards the classifier's params, optimizer state and EMA over the devices
    # (ZeRO-3); 'replicated' keeps a copy on each.
    c.sharding = "replicated"

    # Data (tfds builder names; TFDS_DATA_DIR or `data_dir` says where prepared data lives).
    c.dataset = "sklearn_digits"
    c.data_dir = ml_collections.config_dict.placeholder(str)
    c.train_split = ml_collections.config_dict.placeholder(str)  # default: the dataset's
    c.eval_split = ml_collections.config_dict.placeholder(str)
    c.image_size = 32
    c.augment = "digits"  # 'digits' | 'cifar' | 'imagenet' | 'none'
    c.rand_augment = ""  # timm RandAugment on the crop: 'rand-m9-mstd0.5-inc1'; '' = off
    c.color_jitter = 0.0  # torchvision ColorJitter strength on the crop (thesis: 0.4); 0 = off
    c.crop_area = ()  # 'imagenet' crop's area range; () = (0.08, 1.0)
    c.crop_aspect = ()  # 'imagenet' crop's aspect range; () = (3/4, 4/3)
    c.random_erase_prob = 0.0  # timm RandomErasing (mode 'pixel', 1 box), after normalisation
    c.repeated_augment = 1  # DeiT repeated augmentation: copies of each image; 1 = off
    c.eval_preprocess = ""  # '' = the dataset's default | 'center_crop' (Resize 256, crop 224)
    # RVT* patch-wise augmentation (docs/method.md, "Patch-wise augmentation"): 'off' | 'official' (an extra RSPC forward on
    # the patch-augmented batch whose gradients are discarded, as RSPC_RVT does: only BatchNorm
    # statistics see it) | 'intended' (its gradients are added to the clean batch's).
    c.patch_aug = "off"
    c.shuffle_buffer = 10_000

    # Schedule. `batch_size` is global (all devices of all hosts).
    c.batch_size = 128
    c.eval_batch_size = 256
    c.num_epochs = 30.0
    c.total_steps = 0  # > 0 overrides num_epochs

    c.optimizer = ml_collections.ConfigDict(
        dict(
            lr=5e-4,  # peak lr = lr * batch_size / lr_base_batch (DeiT)
            lr_base_batch=512,
            warmup_epochs=5.0,
            cooldown_epochs=0.0,  # at min_lr after the cosine, inside num_epochs (timm)
            warmup_lr=1e-6,
            min_lr=1e-5,
            b1=0.9,
            b2=0.999,
            eps=1e-8,
            weight_decay=0.05,
            # 'per_step' (warm-up and cosine move every step) | 'official_epochs' (timm's
            # scheduler stepped per epoch as RVT's main steps it: epoch e at lr(e - 1), for
            # step-for-step comparisons with the official code); docs/method.md, schedule.
            schedule="per_step",
        )
    )
    c.label_smoothing = 0.0
    # Mixup/CutMix (off when both alphas are 0). DeiT/RVT: 0.8 / 1.0, smoothing 0.1.
    c.mixup = ml_collections.ConfigDict(
        dict(mixup_alpha=0.0, cutmix_alpha=0.0, prob=1.0, switch_prob=0.5)
    )
    c.ema_decay = 0.0  # per-step decay of a classifier EMA; 0 = off
    # The EMA also averages the BatchNorm statistics (timm's ModelEmaV2, which the official
    # runs evaluate); False = EMA evaluation uses the live statistics (runs before this option).
    c.ema_batch_stats = True
    # Micro-batches per optimizer step: each device's batch is split into this many, their
    # gradients summed in one compiled loop (memory of one micro-batch; batch_size stays the
    # global batch the schedule and throughput count). BatchNorm sees each micro-batch.
    c.grad_accum_steps = 1

    # RSPC (defaults = the official code; see rspc_jax/rspc.py).
    c.rspc = ml_collections.ConfigDict(
        dict(
            enabled=True,
            rho=0.1,  # fraction of patches occluded
            lam=0.005,  # weight of the alignment loss
            patch_size=0,  # 0 = the model's patch size
            ste="clip",  # 'clip' (hardtanh backward, official) | 'identity'
            # Emulates the GradScaler's 2**16 on C's gradient (1 = paper). It scales the gradient
            # of the global-mean loss; official runs scaled each GPU's mean loss, so emulating
            # per-GPU batch b needs 2**16 * batch_size / b.
            corruption_grad_scale=65536.0,
            noise_space="normalized",  # 'normalized' (official) | 'pixel' (U[0,1) pixels, as the paper words it)
            clamp="imagenet",  # 'imagenet' (official, even on CIFAR) | 'dataset' | 'none'
            selection="learned",  # 'learned' | 'random' (Table 3) | 'random_object' (control)
            # | 'attended' | 'random_attended': the classifier's own attention picks the patches
            # (docs/method.md, "Occluding what the classifier attends to"; no C):
            attended_pool=2.0,  # 'random_attended': k at random among round(this * k) most attended
            # Beyond the paper (docs/method.md, "A per-image C"): 'official' | 'content' (scores
            # from each patch's own pixels, exactly k per image by Gumbel top-k).
            corruption_model="official",
            temperature=0.0,  # > 0: C's masks sampled by Gumbel top-k at this temperature
            # Beyond the paper (docs/method.md, "Mixed masks"; defaults = C's masks whole):
            learned_fraction=1.0,  # of the occluded patches, this fraction C's, the rest random
            learned_fraction_ramp_epochs=0.0,  # > 0: that fraction ramps up from 0 (HPM)
            learned_batch_fraction=1.0,  # C's masks on this share of the batch (AttMask)
            # Beyond the paper (docs/method.md, "A schedule on C's objective"; 0 = official):
            corruption_warmup_epochs=0.0,  # C frozen for these epochs, then it ascends
            corruption_curriculum_epochs=0.0,  # then C's gradient goes -1 -> +1 (helping first)
            # Beyond the paper (docs/method.md, "A diversity term on C's scores"; 0 = official):
            corruption_diversity=0.0,  # > 0: C also spreads its choices over the batch
            objective="align",  # 'align' (eq. 2) | 'ce': CE on the occluded images instead (ablation)
            fill="noise",  # occluded patches: 'noise' (eq. 1) | 'zero' (0 in the model input)
            # | 'drop' (removed from the token sequence; ViT/DeiT)
            align_blocks=(),  # () = all backbone blocks
            optimizer=ml_collections.ConfigDict(
                dict(lr=1e-4, momentum=0.9, nesterov=True, weight_decay=0.05, clip_norm=5.0)
            ),
        )
    )

    # Adversarial-training baselines (rspc_jax/adversarial_training.py), with rspc.enabled=False.
    c.adversarial = ml_collections.ConfigDict(
        dict(
            method="none",  # 'none' | 'fgsm' | 'pgd' | 'trades'
            eps=4 / 255,  # L-inf budget, pixels in [0, 1] (thesis ImageNet: 4/255)
            steps=1,  # attack steps (fgsm: 1, or 2 = the thesis's 2-step FGSM)
            step_size=0.0,  # 0 = eps / steps (fgsm), 2.5 eps / steps (pgd, trades)
            beta=6.0,  # TRADES weight of the KL term
            eps_warmup_epochs=0,  # eps grows linearly over these epochs (thesis: 10)
            attack_bn="train",  # BatchNorm in the attack: 'train' (thesis) | 'eval'
        )
    )

    # Robustness evaluation (`python -m rspc_jax.evaluate`; README "Evaluate robustness").
    c.evaluation = ml_collections.ConfigDict(
        dict(
            suites="clean,corrupted_local,patch_occlusion,attention_stability,adversarial",
            batch_size=0,  # global; 0 = eval_batch_size
            num_examples=0,  # cap on eval examples per suite; 0 = all
            figure_images=4,  # images shown in the attention / mask figures
            corruptions="common",  # common (the 15) | all (19) | a comma list
            severities=(1, 2, 3, 4, 5),
            # Released benchmark data ('' = the tfds builder in data_dir where one exists).
            imagenet_c_dir="",  # <dir>/<corruption>/<severity>/<wnid>/*.JPEG
            imagenet_a_dir="",  # <dir>/<wnid>/*.jpg (200 wnids)
            imagenet_r_dir="",
            imagenet_p_dir="",  # <dir>/<perturbation>/<wnid>/*.mp4
            imagenet_p_perturbations="",  # comma list; '' = the 10 test perturbations
            imagenet_p_alexnet="",  # JSON {flip_probability: {p: v}, top5_distance: {p: v}}
            cifar10_c_dir="",  # <dir>/<corruption>.npy + labels.npy
            cifar100_c_dir="",
            occlusion_rho=0.1,  # the paper's analyses occlude 10% of the patches
            occlusion_masks=100,  # random masks per image (Fig. 2 right)
            # Where there are at most this many masks of the same count (120 for 2 of 16
            # patches), every one is tried too: the worst-case occlusion accuracy.
            occlusion_every_mask_limit=256,
            # transfer_occlusion: the workdir of a run whose trained C's masks are applied
            # to the evaluated model (a fixed adversary for every method of a study).
            transfer_from="",
            fgsm_eps=1 / 255,  # RSPC_RVT --fgsm_test
            pgd_eps=8 / 255,
            pgd_step=2 / 255,
            pgd_steps=5,  # RSPC_RVT --pgd_test
            apgd_eps=4 / 255,  # RobustBench ImageNet L-inf
            apgd_iters=100,  # APGD and FAB iterations
            apgd_targets=9,  # target classes of APGD-T and FAB-T in AutoAttack
            autoattack_version="standard",  # 'standard' | 'rand' (EOT, randomised models)
            square_queries=5000,
            adversarial_examples=1000,  # attacks run on the first N eval examples
            attacks="fgsm,pgd,apgd_ce,autoattack,patch_fool",  # which the adversarial suite runs
            patch_fool_patches=1,
            patch_fool_block=4,
            patch_fool_steps=250,
        )
    )

    # Model-robustness analyses (`python -m rspc_jax.analyze`; README "Analyse a model").
    c.analysis = ml_collections.ConfigDict(
        dict(
            batch_size=0,  # global; 0 = eval_batch_size
            num_examples=0,  # cap on eval examples per pass; 0 = all
            lesion_samples=25,  # random draws of n removed blocks, per n (Fig. 8)
            radii=(),  # restricted-attention distances; () = 0 .. grid side - 1
            random_mask_seed=0,  # the fixed permutation of the random-mask baseline
            cls_only_blocks=(),  # k of "no patch-to-patch attention in the first/last k"; () = all
            max_translation=16.0,
            translations=9,  # pixels each way, values per axis
            max_rotation=30.0,
            rotations=31,  # degrees each way, values
            spatial_examples=1000,  # the grid attack runs on the first N eval examples
        )
    )

    # Loop.
    c.log_every_steps = 50
    c.eval_every_steps = 0  # 0 = once per epoch
    c.eval_fgsm_eps = 0.0  # > 0: evals also report FGSM accuracy at this eps (pixels in [0, 1])
    c.keep_best = (
        ""  # 'accuracy' | 'fgsm_accuracy': also keep the best eval's state in <workdir>/best
    )
    c.checkpoint_every_steps = 500
    c.keep_checkpoints = 3
    c.block_each_step = (
        "auto"  # 'auto' (block on CPU, where queued collectives deadlock) | 'yes' | 'no'
    )
    # jax.transfer_guard around the steps between log, eval and checkpoint steps: 'allow' |
    # 'log' | 'disallow' (debugging: an implicit host<->device transfer there is a stall).
    c.transfer_guard = "allow"
    # Train steps per compiled call between log, eval and checkpoint steps (one lax.scan
    # over that many batches; those steps themselves run alone). One dispatch per call, and
    # on CPU XLA maps the step's temporaries afresh once per call instead of once per step
    # (which matters with glibc's allocator, not with tcmalloc). A stop request (SIGTERM,
    # should_stop) is seen at the end of a call. 1 = one step per call.
    c.steps_per_call = 1
    c.distributed = "auto"  # jax.distributed.initialize: 'auto' | 'yes' | 'no'
    # Before the first step, compare XLA's memory estimate of the compiled train step with the
    # memory it will have (the device's; on CPU what the process can take) and stop with the
    # numbers and the fixes when it does not fit (rspc_jax/training/memory_check.py; the
    # environment variable RSPC_JAX_MEMORY_LIMIT_GIB sets the limit). False = run anyway.
    c.memory_check = True
    return c

//! The slice of the UCP C API that kvduplex calls, loaded at run time.
//!
//! UCX comes from the `libucx-cu12` wheel (or any UCX >= 1.16 install), so nothing here needs
//! UCX headers or libraries at build time. Struct layouts follow UCX 1.22's `ucp.h`; every
//! parameter struct is read by UCX only for the fields named in its `field_mask`, which is what
//! makes a hand-written prefix of the struct (plus zeroed reserve space) safe to pass.
#![allow(non_camel_case_types)]

use std::ffi::{c_char, c_int, c_uint, c_void, CStr};
use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use libloading::os::unix::{Library, Symbol, RTLD_GLOBAL, RTLD_NOW};

pub type ucs_status_t = i32;
pub type ucs_status_ptr_t = *mut c_void;
pub type ucp_context_h = *mut c_void;
pub type ucp_worker_h = *mut c_void;
pub type ucp_ep_h = *mut c_void;
pub type ucp_mem_h = *mut c_void;
pub type ucp_rkey_h = *mut c_void;
pub type ucp_config_t = c_void;
pub type ucp_address_t = c_void;
pub type ucp_send_nbx_callback_t = Option<
    unsafe extern "C" fn(request: *mut c_void, status: ucs_status_t, user_data: *mut c_void),
>;
pub type ucp_err_handler_cb_t =
    Option<unsafe extern "C" fn(arg: *mut c_void, ep: ucp_ep_h, status: ucs_status_t)>;

pub const UCS_OK: ucs_status_t = 0;
pub const UCS_INPROGRESS: ucs_status_t = 1;
pub const UCS_ERR_BUSY: ucs_status_t = -15;
const UCS_ERR_LAST: isize = -100;

pub const UCP_API_MAJOR: c_uint = 1;
/// The oldest API minor we need: `ucp_get_nbx`, `ucp_ep_close_nbx`, `ucp_mem_query`.
pub const UCP_API_MINOR: c_uint = 16;

const fn bit(n: u32) -> u64 {
    1u64 << n
}
pub const UCP_PARAM_FIELD_FEATURES: u64 = bit(0);
pub const UCP_PARAM_FIELD_NAME: u64 = bit(8);
pub const UCP_FEATURE_RMA: u64 = bit(1);
pub const UCP_FEATURE_WAKEUP: u64 = bit(4);
pub const UCP_WORKER_PARAM_FIELD_THREAD_MODE: u64 = bit(0);
pub const UCS_THREAD_MODE_SERIALIZED: c_int = 1;
pub const UCP_EP_PARAM_FIELD_REMOTE_ADDRESS: u64 = bit(0);
pub const UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE: u64 = bit(1);
pub const UCP_EP_PARAM_FIELD_ERR_HANDLER: u64 = bit(2);
pub const UCP_ERR_HANDLING_MODE_NONE: c_int = 0;
pub const UCP_ERR_HANDLING_MODE_PEER: c_int = 1;
pub const UCP_MEM_MAP_PARAM_FIELD_ADDRESS: u64 = bit(0);
pub const UCP_MEM_MAP_PARAM_FIELD_LENGTH: u64 = bit(1);
pub const UCP_MEM_ATTR_FIELD_MEM_TYPE: u64 = bit(2);
pub const UCP_OP_ATTR_FIELD_CALLBACK: u32 = 1 << 1;
pub const UCP_OP_ATTR_FIELD_USER_DATA: u32 = 1 << 2;
pub const UCP_OP_ATTR_FIELD_FLAGS: u32 = 1 << 4;
pub const UCP_OP_ATTR_FIELD_MEMH: u32 = 1 << 8;
pub const UCP_EP_CLOSE_FLAG_FORCE: u32 = 1;
pub const UCS_MEMORY_TYPE_HOST: u32 = 0;
pub const UCS_MEMORY_TYPE_CUDA: u32 = 1;
pub const UCS_MEMORY_TYPE_CUDA_MANAGED: u32 = 2;

/// Zeroed room after the fields we set, so UCX versions with longer structs never read past
/// our allocation even if they copy the whole struct.
type Reserve = [u64; 32];

#[repr(C)]
pub struct ucp_params_t {
    pub field_mask: u64,
    pub features: u64,
    pub request_size: usize,
    pub request_init: *const c_void,
    pub request_cleanup: *const c_void,
    pub tag_sender_mask: u64,
    pub mt_workers_shared: c_int,
    pub estimated_num_eps: usize,
    pub estimated_num_ppn: usize,
    pub name: *const c_char,
    pub reserve: Reserve,
}

#[repr(C)]
pub struct ucp_worker_params_t {
    pub field_mask: u64,
    pub thread_mode: c_int,
    pub reserve: Reserve,
}

#[repr(C)]
pub struct ucp_ep_params_t {
    pub field_mask: u64,
    pub address: *const ucp_address_t,
    pub err_mode: c_int,
    pub err_handler_cb: ucp_err_handler_cb_t,
    pub err_handler_arg: *mut c_void,
    pub reserve: Reserve,
}

#[repr(C)]
pub struct ucp_mem_map_params_t {
    pub field_mask: u64,
    pub address: *mut c_void,
    pub length: usize,
    pub reserve: Reserve,
}

#[repr(C)]
pub struct ucp_mem_attr_t {
    pub field_mask: u64,
    pub address: *mut c_void,
    pub length: usize,
    pub mem_type: u32,
}

/// `ucp_request_param_t`, complete: UCX reads it field by field according to `op_attr_mask`.
#[repr(C)]
pub struct ucp_request_param_t {
    pub op_attr_mask: u32,
    pub flags: u32,
    pub request: *mut c_void,
    pub cb: ucp_send_nbx_callback_t,
    pub datatype: u64,
    pub user_data: *mut c_void,
    pub reply_buffer: *mut c_void,
    pub memory_type: u32,
    pub recv_info: *mut c_void,
    pub memh: ucp_mem_h,
    pub remote_datatype: u64,
    pub remote: *const c_void,
    pub remote_count: usize,
}

impl Default for ucp_request_param_t {
    fn default() -> Self {
        // SAFETY: all-zero is a valid value for every field (null pointers, None callbacks).
        unsafe { std::mem::zeroed() }
    }
}

/// Decodes UCX's status-pointer convention: null = done, small negative = error, else a request.
pub enum StatusPtr {
    Done,
    Pending(*mut c_void),
    Failed(ucs_status_t),
}

pub fn status_ptr(p: ucs_status_ptr_t) -> StatusPtr {
    let raw = p as isize;
    if p.is_null() {
        StatusPtr::Done
    } else if (UCS_ERR_LAST..0).contains(&raw) {
        StatusPtr::Failed(raw as ucs_status_t)
    } else {
        StatusPtr::Pending(p)
    }
}

macro_rules! ucp_api {
    ($($name:ident: fn($($arg:ty),*) $(-> $ret:ty)?;)*) => {
        /// Function pointers into the loaded libucp/libucs.
        pub struct Api {
            $(pub $name: unsafe extern "C" fn($($arg),*) $(-> $ret)?,)*
            pub lib_dir: Option<PathBuf>,
            _libs: Vec<Library>,
        }

        impl Api {
            fn resolve(libs: Vec<Library>, lib_dir: Option<PathBuf>) -> Result<Api, String> {
                $(
                    let $name = find_symbol(&libs, stringify!($name))?;
                )*
                Ok(Api { $($name,)* lib_dir, _libs: libs })
            }
        }
    };
}

ucp_api! {
    ucp_config_read: fn(*const c_char, *const c_char, *mut *mut ucp_config_t) -> ucs_status_t;
    ucp_config_release: fn(*mut ucp_config_t);
    ucp_init_version: fn(c_uint, c_uint, *const ucp_params_t, *const ucp_config_t, *mut ucp_context_h) -> ucs_status_t;
    ucp_cleanup: fn(ucp_context_h);
    ucp_worker_create: fn(ucp_context_h, *const ucp_worker_params_t, *mut ucp_worker_h) -> ucs_status_t;
    ucp_worker_destroy: fn(ucp_worker_h);
    ucp_worker_get_address: fn(ucp_worker_h, *mut *mut ucp_address_t, *mut usize) -> ucs_status_t;
    ucp_worker_release_address: fn(ucp_worker_h, *mut ucp_address_t);
    ucp_worker_progress: fn(ucp_worker_h) -> c_uint;
    ucp_worker_get_efd: fn(ucp_worker_h, *mut c_int) -> ucs_status_t;
    ucp_worker_arm: fn(ucp_worker_h) -> ucs_status_t;
    ucp_worker_signal: fn(ucp_worker_h) -> ucs_status_t;
    ucp_ep_create: fn(ucp_worker_h, *const ucp_ep_params_t, *mut ucp_ep_h) -> ucs_status_t;
    ucp_ep_close_nbx: fn(ucp_ep_h, *const ucp_request_param_t) -> ucs_status_ptr_t;
    ucp_mem_map: fn(ucp_context_h, *const ucp_mem_map_params_t, *mut ucp_mem_h) -> ucs_status_t;
    ucp_mem_unmap: fn(ucp_context_h, ucp_mem_h) -> ucs_status_t;
    ucp_mem_query: fn(ucp_mem_h, *mut ucp_mem_attr_t) -> ucs_status_t;
    ucp_rkey_pack: fn(ucp_context_h, ucp_mem_h, *mut *mut c_void, *mut usize) -> ucs_status_t;
    ucp_rkey_buffer_release: fn(*mut c_void);
    ucp_ep_rkey_unpack: fn(ucp_ep_h, *const c_void, *mut ucp_rkey_h) -> ucs_status_t;
    ucp_rkey_destroy: fn(ucp_rkey_h);
    ucp_get_nbx: fn(ucp_ep_h, *mut c_void, usize, u64, ucp_rkey_h, *const ucp_request_param_t) -> ucs_status_ptr_t;
    ucp_request_check_status: fn(*mut c_void) -> ucs_status_t;
    ucp_request_free: fn(*mut c_void);
    ucs_status_string: fn(ucs_status_t) -> *const c_char;
}

fn find_symbol<T: Copy>(libs: &[Library], name: &str) -> Result<T, String> {
    for lib in libs.iter().rev() {
        // SAFETY: the symbol's type is fixed by the `ucp_api!` table above, which follows ucp.h.
        let sym: Result<Symbol<T>, _> = unsafe { lib.get(name.as_bytes()) };
        if let Ok(sym) = sym {
            return Ok(*sym);
        }
    }
    Err(format!("UCX symbol {name} not found in the loaded libraries"))
}

/// The UCX libraries in dependency order; the wheel's RUNPATH points at a build directory that
/// does not exist, so each must be loaded by absolute path before the next.
const LIBRARIES: [&str; 4] = ["libucs.so.0", "libucm.so.0", "libuct.so.0", "libucp.so.0"];

fn load(lib_dir: Option<&Path>) -> Result<Api, String> {
    let mut libs = Vec::with_capacity(LIBRARIES.len());
    for name in LIBRARIES {
        let target = match lib_dir {
            Some(dir) => dir.join(name),
            None => PathBuf::from(name),
        };
        // SAFETY: loading UCX runs its library constructors, which is what UCX expects;
        // RTLD_GLOBAL lets its transport modules (libuct_cma.so, ...) resolve against it.
        let lib = unsafe { Library::open(Some(&target), RTLD_NOW | RTLD_GLOBAL) }
            .map_err(|e| format!("cannot load {}: {e}", target.display()))?;
        libs.push(lib);
    }
    Api::resolve(libs, lib_dir.map(Path::to_path_buf))
}

static API: OnceLock<Result<Api, String>> = OnceLock::new();

/// Loads UCX once per process. The directory comes from the caller, else
/// `$KVDUPLEX_UCX_LIB_DIR`, else the dynamic loader's search path.
pub fn api(lib_dir: Option<&Path>) -> Result<&'static Api, String> {
    let result = API.get_or_init(|| {
        let from_env = std::env::var_os("KVDUPLEX_UCX_LIB_DIR").map(PathBuf::from);
        let dir = lib_dir.map(Path::to_path_buf).or(from_env);
        let loaded = load(dir.as_deref());
        if let Ok(api) = &loaded {
            log::info!(
                "loaded UCX from {}",
                api.lib_dir
                    .as_deref()
                    .map_or("the loader path".into(), |d| d.display().to_string())
            );
        }
        loaded
    });
    let api = result.as_ref().map_err(Clone::clone)?;
    if let (Some(wanted), Some(have)) = (lib_dir, api.lib_dir.as_deref()) {
        if wanted != have {
            log::warn!("UCX already loaded from {}; ignoring {}", have.display(), wanted.display());
        }
    }
    Ok(api)
}

impl Api {
    pub fn status_text(&self, status: ucs_status_t) -> String {
        // SAFETY: ucs_status_string returns a pointer to a static string for any status value.
        let text = unsafe { CStr::from_ptr((self.ucs_status_string)(status)) };
        format!("{} ({status})", text.to_string_lossy())
    }
}

//! Any request body through the router's parsing and checks of a chat completion: an answer
//! (accepted, or refused with a 4xx error), never a panic.
#![no_main]

use deepseek_recipe::openai::ChatCompletionRequest;
use libfuzzer_sys::fuzz_target;
use router::api::chat;

fuzz_target!(|body: &[u8]| {
    let Ok(mut obj) = chat::parse_object(body) else {
        return;
    };
    chat::normalize_tool_arguments(&mut obj, "messages", chat::chat_tool_calls);
    let checked = chat::check_tool_choice(&obj).and_then(|()| chat::check_sampling(&mut obj));
    match checked {
        Ok(_) => {
            if let Err(e) = chat::deserialize::<ChatCompletionRequest>(obj) {
                assert!(e.parts().0.is_client_error(), "{e}");
            }
        }
        Err(e) => assert!(e.parts().0.is_client_error(), "{e}"),
    }
});
